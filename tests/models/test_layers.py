"""The shared layers (models/layers.py) in fast mode hand prompt-sized work to the native kernels
and must agree with their own PyTorch path."""
from __future__ import annotations

import pytest
import torch

from edgellm import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native kernels (a C compiler)")


def test_attention_with_every_key_visible_is_not_causal():
    from edgellm.models.layers import attention

    g = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(3, 1, 2, 6, 64, generator=g)
    ours = attention(q, k, v, None, scale=0.125, native=True)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125)
    tolerance = 4 * 2 ** -9 * float(v.abs().max()) if kernels.attention_bf16_values(q.shape[-2]) else 1e-4
    assert (ours - reference).abs().max() < tolerance


def test_fused_norms_match_the_pytorch_layer():
    from edgellm.models.layers import RMSNorm

    g = torch.Generator().manual_seed(11)
    norm = RMSNorm(torch.rand(640, generator=g) + 0.5, 1e-6, native=True)
    x = torch.randn(1, 9, 640, generator=g) * 3
    y = (torch.randn(1, 9, 640, generator=g) * 5).to(kernels.compute_dtype())
    reference = norm(x)
    ours = norm.for_linear(x)
    assert ours.dtype == kernels.compute_dtype()  # a prompt's linear input, cast in the same pass
    assert ((ours.float() - reference).abs() <= reference.abs() * 2 ** -8 + 1e-6).all()
    torch.testing.assert_close(norm.add_to(x, y), x + norm(y), atol=1e-5, rtol=1e-5)
    few = x[:, :4]  # decode-sized: stays fp32 for the exact int16-activation GEMVs
    assert norm.for_linear(few).dtype == torch.float32
