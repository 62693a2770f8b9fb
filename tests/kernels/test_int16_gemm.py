"""The integer prompt GEMM (int16_gemm.c, AVX-VNNI builds) against an fp64 reference of the same
quantization (11-bit weights, int16 activations, per group of 64) and against the fp32 product."""
from __future__ import annotations

import pytest
import torch

from edgellm import kernels
from edgellm.kernels.isa import Variant, cpu_features

VNNI = Variant("avx2", frozenset({"vnni"}))
needs_vnni = pytest.mark.skipif("avx_vnni" not in cpu_features(), reason="the CPU has no AVX-VNNI")


def _quantized_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The integers int16_gemm.c multiplies, in fp64."""
    (n, k), t, g = w.shape, x.shape[0], 64
    wg, xg = w.double().view(n, k // g, g), x.double().view(t, k // g, g)
    sw = (wg.abs().amax(-1, keepdim=True) / 1023).clamp_min(1e-300)
    sx = (xg.abs().amax(-1, keepdim=True) / 32639).clamp_min(1e-300)
    return torch.einsum("tgk,ngk,tg,ng->tn", torch.round(xg / sx), torch.round(wg / sw), sx[..., 0], sw[..., 0])


@needs_vnni
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("t, n, k", [(1, 16, 64), (7, 64, 128), (13, 256, 640), (33, 48, 2048)])
def test_int16_gemm_computes_the_quantized_product(transposed, t, n, k):
    lib = kernels.library_for(VNNI)
    gen = torch.Generator().manual_seed(t * n + k)
    x, w = torch.randn(t, k, generator=gen), torch.randn(n, k, generator=gen)
    w[3 % n, :64] = 0.0  # an all-zero group
    x[0, 64 % k:] *= 50.0  # outliers in the later groups of one token
    y = kernels.int16_gemm(x, w.T.contiguous() if transposed else w, transposed, lib=lib)
    exact, fp32 = _quantized_product(x, w), x.double() @ w.double().T
    scale = fp32.abs().amax(dim=1, keepdim=True)
    # a product that lands on a rounding tie may round the other way in float: a few units of 1/1023
    assert ((y.double() - exact).abs() <= 2e-4 * scale).all()
    assert ((y.double() - fp32).abs() <= 3e-3 * scale).all()  # 11-bit weights: ~1/2046 of a group's largest


@needs_vnni
def test_prompt_matmul_takes_the_int16_gemm_only_on_shapes_it_covers():
    lib = kernels.library_for(VNNI)
    assert kernels.int16_gemm_native(lib) and kernels.int16_gemm_supports(64, 128, lib)
    assert not kernels.int16_gemm_supports(72, 128, lib) and not kernels.int16_gemm_supports(64, 96, lib)
    with pytest.raises(ValueError, match="K % 64"):
        kernels.int16_gemm(torch.randn(2, 96), torch.randn(64, 96), lib=lib)
    with pytest.raises(ValueError, match="fp32"):
        kernels.int16_gemm(torch.randn(2, 128).bfloat16(), torch.randn(64, 128), lib=lib)


def test_int16_gemm_is_only_in_avx_vnni_builds(variant, lib):
    assert kernels.int16_gemm_native(lib) == (variant.name == "avx2" and "vnni" in variant.extras)
