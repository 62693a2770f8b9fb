"""edgellm's native INT4 decode kernel (kernels/int4_gemv.c) against an fp64 reference of the
dequantized weight, on torch's own packed bytes."""
from __future__ import annotations

import pytest
import torch

from edgellm import kernels
from edgellm.quant.linear import Int4Linear

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs AVX-512 VNNI and a C compiler")


def _layer(n: int, k: int, planes: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, planes * k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, planes * k // group, generator=g) * 0.02 + 1e-3
    zero = torch.randn(n, planes * k // group, generator=g) * 0.01
    layer = Int4Linear(q, scale, zero, planes=planes, group=group)
    expand = lambda t: t.bfloat16().double().repeat_interleave(group, 1)  # noqa: E731  (the kernel reads bf16)
    w = (q.double() - 8) * expand(scale) + expand(zero)
    return layer, w.view(n, planes, k).sum(1)


@pytest.mark.parametrize("n, k, planes, group", [(64, 64, 1, 32), (960, 576, 1, 32), (576, 1536, 1, 64),
                                                 (128, 640, 2, 32), (192, 256, 1, 128)])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_kernel_matches_the_dequantized_weight(n, k, planes, group, m):
    layer, w = _layer(n, k, planes, group)
    x = torch.randn(m, k, dtype=torch.float64) * 3
    reference = x @ w.T
    ours = kernels.int4_gemv(x.float(), layer.packed, layer.scale_zero, group, planes).double()
    scale = reference.abs().max()
    assert (ours - reference).abs().max() < 2e-4 * scale  # int16 activations: ~1e-5 measured
    # torch's bf16 path for comparison is ~100x further off
    theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.bfloat16().repeat(1, planes), layer.packed, group, layer.scale_zero).double()
    assert (ours - reference).abs().max() < (theirs - reference).abs().max()


def test_linear_uses_the_kernel_for_decode_only():
    layer, w = _layer(128, 256, 1, 32)
    assert layer.native
    one = layer(torch.randn(1, 1, 256))
    assert one.dtype == torch.float32 and one.shape == (1, 1, 128)  # kernel: fp32 out
    many = layer(torch.randn(1, 16, 256))
    assert many.dtype == torch.bfloat16  # prefill: torch's kernel


def test_zero_and_extreme_activations():
    layer, w = _layer(64, 128, 1, 32, seed=3)
    x = torch.zeros(2, 128)
    x[1, 5] = 1e4
    x[1, 100] = -3e-3
    ours = kernels.int4_gemv(x, layer.packed, layer.scale_zero, 32, 1).double()
    reference = x.double() @ w.T
    assert torch.allclose(ours[0], torch.zeros(64, dtype=torch.float64))
    assert (ours[1] - reference[1]).abs().max() < 1e-4 * reference[1].abs().max()
