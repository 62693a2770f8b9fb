import mmap
import random
import time
import warnings

import pytest
import torch

from edgellm.quant.ggml import (
    BLOCK_SIZES,
    DEQUANT_TYPES,
    GGMLType,
    dequantize,
    int4_affine,
    tensor_nbytes,
)

from . import reference

FORMATS = list(reference.SIZES)
INT4_FORMATS = ["Q4_0", "Q4_1", "Q4_K"]


def _shape(fmt: str, rows: int = 3, blocks_per_row: int = 4) -> tuple[int, int]:
    elems, _ = reference.SIZES[fmt]
    return rows, blocks_per_row * elems if elems > 1 else 7


def _random(fmt: str, shape: tuple[int, ...], seed: int = 0) -> bytes:
    return reference.random_tensor(fmt, shape[0] * shape[1], random.Random(f"{fmt}/{seed}"))


def _as_raw(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # 1e-6 relative, with an absolute floor scaled to the tensor so values that
    # come from cancellation (q*d - m near 0) are not held to a relative bound.
    atol = 1e-6 * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=atol)


def test_enum_values_match_gguf_spec():
    expected = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
                "Q8_1": 9, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
                "Q8_K": 15, "BF16": 30}
    assert {name: int(GGMLType[name]) for name in expected} == expected


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_sizes_match_reference(fmt):
    assert BLOCK_SIZES[GGMLType[fmt]] == reference.SIZES[fmt]


def test_tensor_nbytes():
    assert tensor_nbytes(GGMLType.F32, 10) == 40
    assert tensor_nbytes(GGMLType.BF16, 3) == 6
    assert tensor_nbytes(GGMLType.Q8_0, 64) == 68
    assert tensor_nbytes(GGMLType.Q4_K, 576 * 256) == 576 * 144
    assert tensor_nbytes(int(GGMLType.Q6_K), 512) == 420
    assert tensor_nbytes(GGMLType.Q2_K, 256) == 84  # sized even though not decodable
    assert tensor_nbytes(GGMLType.Q4_0, 0) == 0


@pytest.mark.parametrize(
    "ggml_type, n",
    [(GGMLType.Q4_0, 33), (GGMLType.Q4_K, 128), (GGMLType.Q8_0, -32), (4, 32), (999, 1)],
)
def test_tensor_nbytes_rejects_bad_sizes_and_types(ggml_type, n):
    with pytest.raises(ValueError):
        tensor_nbytes(ggml_type, n)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_reference(fmt):
    shape = _shape(fmt)
    data = _random(fmt, shape)
    expected = torch.tensor(reference.decode(fmt, data), dtype=torch.float32).reshape(shape)
    raw = _as_raw(data)
    before = raw.clone()
    out = dequantize(raw, GGMLType[fmt], shape)
    assert out.dtype == torch.float32 and out.shape == shape
    _assert_matches(out, expected)
    assert torch.equal(raw, before)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if reference.SIZES[f][0] > 1])
def test_dequantize_matches_gguf_py(fmt):
    # A second, unrelated implementation (ggml's own Python port) guards
    # against the reference and the code sharing a misreading of the spec.
    gguf_quants = pytest.importorskip("gguf.quants")
    np = pytest.importorskip("numpy")
    shape = _shape(fmt, rows=2, blocks_per_row=2)
    data = _random(fmt, shape, seed=1)
    theirs = gguf_quants.dequantize(np.frombuffer(data, dtype=np.uint8), GGMLType[fmt].value)
    expected = torch.from_numpy(theirs.astype(np.float32).reshape(shape))
    _assert_matches(dequantize(_as_raw(data), GGMLType[fmt], shape), expected)


def test_dequantize_3d_and_1d_shapes():
    data = _random("Q8_0", (4, 64))
    flat = dequantize(_as_raw(data), GGMLType.Q8_0, (256,))
    cube = dequantize(_as_raw(data), GGMLType.Q8_0, (2, 2, 64))
    assert torch.equal(flat.reshape(2, 2, 64), cube)


@pytest.mark.parametrize("fmt, offset", [("F32", 3), ("F16", 1), ("Q4_K", 3), ("Q6_K", 32)])
def test_dequantize_read_only_mmap_view(tmp_path, fmt, offset):
    # The loader hands over views of a read-only mmap at arbitrary offsets:
    # any write would crash, and unaligned views must still decode.
    shape = _shape(fmt, rows=2, blocks_per_row=2)
    data = _random(fmt, shape, seed=2)
    path = tmp_path / "blob.bin"
    path.write_bytes(b"\xaa" * offset + data + b"\x55" * 7)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns that mmap is not writable
            raw = torch.frombuffer(mm, dtype=torch.uint8, offset=offset, count=len(data))
        out = dequantize(raw, GGMLType[fmt], shape)
        del raw
    _assert_matches(out, dequantize(_as_raw(data), GGMLType[fmt], shape))
    out.add_(1)  # the result is a private copy, writable


def test_dequantize_rejects_bad_input():
    data = _as_raw(_random("Q4_0", (2, 64)))
    with pytest.raises(ValueError, match="bytes"):
        dequantize(data[:-1], GGMLType.Q4_0, (2, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize(data, GGMLType.Q4_0, (8, 16))
    with pytest.raises(ValueError, match="Q2_K"):
        dequantize(data, GGMLType.Q2_K, (1, 256))
    with pytest.raises(ValueError, match="unknown"):
        dequantize(data, 77, (2, 64))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(data.to(torch.int8), GGMLType.Q4_0, (2, 64))


def test_dequant_types_cover_required_formats():
    assert {GGMLType[f] for f in FORMATS} <= DEQUANT_TYPES


@pytest.mark.parametrize("fmt", INT4_FORMATS)
def test_int4_affine_reproduces_dequantize(fmt):
    shape = _shape(fmt, rows=5, blocks_per_row=2)
    raw = _as_raw(_random(fmt, shape, seed=3))
    q, scale, zero = int4_affine(raw, GGMLType[fmt], shape)
    n, k = shape
    assert q.dtype == torch.uint8 and q.shape == (n, k) and int(q.max()) <= 15
    assert scale.dtype == zero.dtype == torch.float32
    assert scale.shape == zero.shape == (n, k // 32)
    rebuilt = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    _assert_matches(rebuilt, dequantize(raw, GGMLType[fmt], shape))


def test_int4_affine_rejects_other_types():
    raw = _as_raw(_random("Q8_0", (2, 32)))
    with pytest.raises(ValueError, match="Q8_0"):
        int4_affine(raw, GGMLType.Q8_0, (2, 32))


def test_dequantize_is_vectorized():
    # A per-block Python loop takes minutes here; the vectorized path ~0.05 s
    # on 2 cores. The bound is loose because the test machine is small and shared.
    n, k = 49152, 576
    raw = torch.full((tensor_nbytes(GGMLType.Q8_0, n * k),), 0x3C, dtype=torch.uint8)
    start = time.perf_counter()
    out = dequantize(raw, GGMLType.Q8_0, (n, k))
    assert time.perf_counter() - start < 5.0
    d = torch.tensor([0x3C3C], dtype=torch.int16).view(torch.float16).item()
    assert out.shape == (n, k) and out[0, 0].item() == out[-1, -1].item() == 0x3C * d
