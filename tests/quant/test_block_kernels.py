"""Native kernels on GGUF blocks read in place (kernels/block_gemv.c, quant/blocks.py), checked
against the independent scalar decoder in tests/quant/reference.py on random blocks, and on the
real Gemma 3 file."""
from __future__ import annotations

import random

import pytest
import torch

from edgellm import kernels
from edgellm.quant.blocks import BlockLinear
from edgellm.quant.ggml import GGMLType

from . import reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs AVX-512 VNNI and a C compiler")

FORMATS = ["Q8_0", "Q5_0", "Q6_K"]


def _weight(fmt: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks (N rows of K) and their fp64 values from the scalar reference."""
    data = reference.random_tensor(fmt, n * k, random.Random(seed))
    values = torch.tensor(reference.decode(fmt, data), dtype=torch.float64).view(n, k)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(n, -1), values


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3])
def test_block_gemv_matches_the_reference_decoder(fmt, m):
    rows, w = _weight(fmt, 48, 512, seed=m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m), dtype=torch.float64)
    reference_y = x @ w.T
    ours = kernels.block_gemv(x.float(), rows, GGMLType[fmt], 512).double()
    assert (ours - reference_y).abs().max() < 2e-4 * reference_y.abs().max()  # int16 activations


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_to_bf16_is_the_weight_rounded_once(fmt):
    rows, w = _weight(fmt, 16, 256, seed=7)
    ours = kernels.blocks_to_bf16(rows, GGMLType[fmt], 256).double()
    assert ((ours - w).abs() <= w.abs() * 2 ** -8).all()  # each weight within one bf16 rounding


def test_fused_parts_of_mixed_formats_for_decode_and_prompt():
    parts = [_weight(fmt, n, 256, seed=i) for i, (fmt, n) in enumerate([("Q5_0", 64), ("Q5_0", 32), ("Q6_K", 16)])]
    linear = BlockLinear([(rows.reshape(-1), GGMLType[fmt], (w.shape[0], 256))
                          for (rows, w), fmt in zip(parts, ["Q5_0", "Q5_0", "Q6_K"])])
    w = torch.cat([w for _, w in parts])
    assert linear.out_features == 112 and linear.out_splits == [64, 32, 16]
    for m in (1, 40):  # one native call per part; a bf16 GEMM over the dequantized stack
        x = torch.randn(1, m, 256, generator=torch.Generator().manual_seed(m))
        reference_y = x.double() @ w.T
        y = linear(x)
        assert y.shape == (1, m, 112)
        assert (y.double() - reference_y).abs().max() < 2e-2 * reference_y.abs().max()


def test_gemma_projections_are_read_in_place(gemma3_path):
    import edgellm

    with edgellm.load(gemma3_path) as model:
        block = model.net.blocks[0]
        assert isinstance(block.attn.qkv_proj, BlockLinear)  # Q5_0 q, k and Q8_0 v
        assert isinstance(block.mlp.gate_up_proj, BlockLinear)  # Q5_0
        assert isinstance(block.mlp.down_proj, BlockLinear)  # Q6_K
        assert isinstance(model.net.lm_head, BlockLinear)  # the tied Q8_0 embedding
        assert block.attn.qkv_proj.nbytes == sum(model.source.tensors[f"blk.0.attn_{p}.weight"].nbytes for p in "qkv")
