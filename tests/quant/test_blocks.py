"""Linears on GGUF blocks and INT8 rows read in place (quant/blocks.py): fused parts of mixed formats
for decode and prompts against the independent scalar decoder in tests/quant/reference.py, edgellm's
INT8 rows, and the real Gemma 3 file. The kernels themselves: tests/kernels/test_gemv.py."""
from __future__ import annotations

import random

import pytest
import torch

from edgellm import kernels
from edgellm.quant.blocks import BlockLinear, widens_q5_0
from edgellm.quant.ggml import GGMLType

from . import reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native kernels (a C compiler)")


def _weight(fmt: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks (N rows of K) and their fp64 values from the scalar reference."""
    data = reference.random_tensor(fmt, n * k, random.Random(seed))
    values = torch.tensor(reference.decode(fmt, data), dtype=torch.float64).view(n, k)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(n, -1), values


def test_fused_parts_of_mixed_formats_for_decode_and_prompt():
    formats = ["Q5_0", "Q5_K", "Q6_K"]
    parts = [_weight(fmt, n, 256, seed=i) for i, (fmt, n) in enumerate(zip(formats, [64, 32, 16]))]
    linear = BlockLinear([(rows.reshape(-1), GGMLType[fmt], (w.shape[0], 256)) for (rows, w), fmt in zip(parts, formats)])
    w = torch.cat([w for _, w in parts])
    assert linear.out_features == 112 and linear.out_splits == [64, 32, 16]
    for m in (1, 40):  # one native call per part; a GEMM in the compute dtype over the dequantized stack
        x = torch.randn(1, m, 256, generator=torch.Generator().manual_seed(m))
        reference_y = x.double() @ w.T
        y = linear(x)
        assert y.shape == (1, m, 112)
        assert (y.double() - reference_y).abs().max() < 2e-2 * reference_y.abs().max()


def test_q8_0_parts_are_held_interleaved_and_give_the_same_products_and_prompt_weights():
    parts = [_weight("Q8_0", 48, 256, seed=1), _weight("Q6_K", 16, 256, seed=2), _weight("Q8_0", 40, 256, seed=3)]
    linear = BlockLinear([(rows.reshape(-1), GGMLType[fmt], (w.shape[0], 256))
                          for (rows, w), fmt in zip(parts, ["Q8_0", "Q6_K", "Q8_0"])])
    assert linear.types == [kernels.Q8R16, GGMLType.Q6_K, GGMLType.Q8_0]  # 40 rows: no whole groups of 16
    w = torch.cat([w for _, w in parts])
    for m in (1, 8, 40):  # native GEMVs; then the prompt's GEMM over the dequantized stack
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
        assert (linear(x).double() - x.double() @ w.T).abs().max() < 2e-2 * (x.double() @ w.T).abs().max()
    alone = BlockLinear([(parts[0][0].reshape(-1), GGMLType.Q8_0, (48, 256))])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    assert torch.equal(linear(x)[:, :48], alone(x))


def test_int8_rows_of_edgellms_scheme_are_read_in_place():
    from edgellm.quant.packed import make_quantized_linear
    from edgellm.quant.schemes import Scheme, quantize

    g = torch.Generator().manual_seed(4)
    weights = [quantize(torch.randn(n, 128, generator=g) * 0.05, Scheme.parse("int8")) for n in (64, 32)]
    linear = make_quantized_linear(weights, "fast")
    assert isinstance(linear, BlockLinear) and linear.types == [GGMLType.I8] * 2
    assert linear.parts[0].rows.ctypes.data == weights[0].q.data_ptr()  # no copy
    w = torch.cat([q.dequantize() for q in weights]).double()
    for m in (1, 40):
        x = torch.randn(m, 128, generator=g)
        assert (linear(x).double() - x.double() @ w.T).abs().max() < 2e-2 * (x.double() @ w.T).abs().max()


def test_gemma_projections_are_read_in_place(gemma3_path):
    import edgellm

    with edgellm.load(gemma3_path) as model:
        block = model.net.blocks[0]
        assert isinstance(block.attn.qkv_proj, BlockLinear)  # Q5_0 q, k and Q8_0 v
        assert isinstance(block.mlp.gate_up_proj, BlockLinear)  # Q5_0
        assert isinstance(block.mlp.down_proj, BlockLinear)  # Q6_K
        assert isinstance(model.net.lm_head, BlockLinear)  # the tied Q8_0 embedding
        tensors = [model.source.tensors[f"blk.0.attn_{p}.weight"] for p in "qkv"]
        widened = widens_q5_0()  # Q8_0 parts are held as Q8R16 (the same bytes, 16 rows interleaved)
        assert block.attn.qkv_proj.types == [kernels.Q8R16 if widened else GGMLType.Q5_0] * 2 + [kernels.Q8R16]
        assert model.net.lm_head.types == [kernels.Q8R16]
        assert model.net.embed.rows.ctypes.data == model.net.lm_head.parts[0].rows.ctypes.data  # one table for both
        # what the planner counts for them (planner.weight_bytes)
        assert block.attn.qkv_proj.nbytes == sum(t.nbytes * 34 // 22 if widened and t.ggml_type == GGMLType.Q5_0
                                                 else t.nbytes for t in tensors)


@pytest.mark.parametrize("m", [1, 3])
def test_q5_0_widened_to_q8_0_holds_the_same_weights_and_gives_the_same_products(m):
    rows, w = _weight("Q5_0", 48, 512, seed=7)
    wide = kernels.q5_0_as_q8_0(rows)
    assert wide.shape == (48, 512 // 32 * 34)
    assert torch.equal(torch.tensor(reference.decode("Q8_0", bytes(wide.flatten().numpy())), dtype=torch.float64).view(48, 512), w)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    # the same int16 weights meet the same activations in the same order: bit for bit
    assert torch.equal(kernels.block_gemv(x, wide, GGMLType.Q8_0, 512), kernels.block_gemv(x, rows, GGMLType.Q5_0, 512))
