"""RoPE's cos and sin are the float32 roundings of the exact values: a prompt's logits then do not
depend on which routine torch picks for float32 cos/sin (in ~1 process of 10 its first call gave
other bits than the next one, and a prompt's logits moved by up to 0.16)."""
from __future__ import annotations

import math

import numpy as np
import torch

from edgellm.models.layers import Rotary


def _rounded(fn, angles: torch.Tensor) -> torch.Tensor:
    return torch.tensor(np.array([fn(float(a)) for a in angles.flatten().tolist()], dtype=np.float32)).view_as(angles)


def test_cos_and_sin_are_the_rounded_exact_values():
    rotary = Rotary(64, 10_000.0)
    positions = torch.arange(97)
    cos, sin = rotary(positions)
    angles = positions.float()[:, None] * torch.from_numpy(rotary.inv_freq)  # the float32 angles both halves share
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(-2)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (97, 1, 64)
    assert torch.equal(cos, _rounded(math.cos, angles))
    assert torch.equal(sin, _rounded(math.sin, angles))


def test_a_batch_of_positions_gets_the_same_bits_as_each_row_alone():
    rotary = Rotary(32, 500_000.0, magnitude=1.25)
    rows = torch.tensor([[5, 6, 7], [1000, 1001, 1002]])
    cos, sin = rotary(rows)
    for i, row in enumerate(rows):
        alone = rotary(row)
        assert torch.equal(cos[i], alone[0]) and torch.equal(sin[i], alone[1])
