"""The GGUF reader: real files load as views; crafted corrupt files raise ModelFormatError."""
from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from edgellm.errors import ModelFormatError
from edgellm.io.gguf import open_gguf
from edgellm.quant.ggml import GGMLType


def _string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def craft(*, magic=b"GGUF", version=3, kv=None, tensors=None, alignment=32, data=None,
          tensor_count=None, kv_count=None) -> bytes:
    """A GGUF file built byte by byte, so each field can be broken on purpose.

    kv: list of (key, type, packed value bytes); tensors: list of (name, dims, type, offset)."""
    kv = kv if kv is not None else [("general.architecture", 8, _string("llama"))]
    tensors = tensors if tensors is not None else [("w", [32, 2], int(GGMLType.F32), 0)]
    out = bytearray(magic + struct.pack("<I", version))
    out += struct.pack("<QQ", len(tensors) if tensor_count is None else tensor_count,
                       len(kv) if kv_count is None else kv_count)
    for key, vtype, value in kv:
        out += _string(key) + struct.pack("<I", vtype) + value
    for name, dims, ttype, offset in tensors:
        out += _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", ttype, offset)
    out += b"\0" * (-len(out) % alignment)
    out += data if data is not None else np.arange(64, dtype=np.float32).tobytes()
    return bytes(out)


def _write(tmp_path: Path, content: bytes, name: str = "model.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


def test_crafted_file_loads_with_metadata_and_tensor_views(tmp_path):
    kv = [("general.architecture", 8, _string("llama")), ("n", 4, struct.pack("<I", 7)),
          ("arr", 9, struct.pack("<IQ", 6, 3) + struct.pack("<3f", 1, 2, 3)),
          ("names", 9, struct.pack("<IQ", 8, 2) + _string("a") + _string("é"))]
    with open_gguf(_write(tmp_path, craft(kv=kv))) as f:
        assert f.metadata["n"] == 7 and f.metadata["names"] == ["a", "é"]
        assert f.metadata["arr"].tolist() == [1.0, 2.0, 3.0]
        info = f.tensors["w"]
        assert info.shape == (2, 32) and info.type_name == "F32"
        raw, again = f.raw("w"), f.raw("w")
        assert np.array_equal(raw.view(np.float32), np.arange(64, dtype=np.float32))
        raw[0] = 7  # both are views of the one mapping, not copies ...
        assert again[0] == 7
    assert (tmp_path / "model.gguf").read_bytes() == craft(kv=kv)  # ... and private: the file is unchanged


def _long_strings(strings: list[bytes]) -> bytes:
    """A string-array value long enough for the reader's compact StringArray."""
    return struct.pack("<IQ", 8, len(strings)) + b"".join(_string(t) for t in strings)


def _vocab(n: int = 1500) -> list[bytes]:
    return [f"tok{i}".encode() for i in range(n)] + ["é€😀".encode(), b"x" * 300]


@pytest.fixture(params=["native", "python"])
def string_walk(request, monkeypatch):
    """Long string arrays walked by the native library, or by the Python loop used without one."""
    if request.param == "python":
        monkeypatch.setattr("edgellm.io.gguf.gguf_string_ends", lambda *args: None)
    return request.param


def test_long_string_arrays_read_compactly_and_equal_the_list(tmp_path, string_walk):
    strings = _vocab()
    with open_gguf(_write(tmp_path, craft(kv=[("general.architecture", 8, _string("llama")),
                                              ("tokens", 9, _long_strings(strings))]))) as f:
        tokens = f.metadata["tokens"]
    assert len(tokens) == len(strings) and tokens[-2] == "é€😀" and tokens[-1] == "x" * 300
    assert tokens[0] == "tok0" and tokens[-3] == "tok1499" and tokens[1:3] == ["tok1", "tok2"]
    assert list(tokens) == [t.decode() for t in strings] and tokens == [t.decode() for t in strings]
    with pytest.raises(IndexError):
        tokens[len(strings)]
    other = strings[:5] + [b"tok5!"] + strings[6:]  # one token changed, same count
    with open_gguf(_write(tmp_path, craft(kv=[("general.architecture", 8, _string("llama")),
                                              ("tokens", 9, _long_strings(other))]), "other.gguf")) as f:
        changed = f.metadata["tokens"]
    assert tokens.fingerprint() != changed.fingerprint()  # what the tokenizer cache is keyed on
    with open_gguf(tmp_path / "model.gguf") as f:
        assert f.metadata["tokens"].fingerprint() == tokens.fingerprint()


@pytest.mark.parametrize("bad", [b"\xff", b"ab\xc3", b"\xe2\x82"])  # invalid, and cut mid-character
@pytest.mark.parametrize("where", [0, 700, -1])
def test_invalid_utf8_in_a_long_string_array_is_a_format_error(tmp_path, bad, where, string_walk):
    strings = _vocab()
    strings.insert(where if where >= 0 else len(strings), bad)
    path = _write(tmp_path, craft(kv=[("general.architecture", 8, _string("llama")), ("tokens", 9, _long_strings(strings))]))
    with pytest.raises(ModelFormatError, match="UTF-8"):
        open_gguf(path)


@pytest.mark.parametrize("cut", [1, 5, 200])  # bytes missing from the end of the array
def test_a_truncated_long_string_array_is_a_format_error(tmp_path, cut, string_walk):
    data = craft(kv=[("general.architecture", 8, _string("llama")), ("tokens", 9, _long_strings(_vocab()))])
    end = data.index(b"x" * 300) + 300
    with pytest.raises(ModelFormatError, match="truncated"):
        open_gguf(_write(tmp_path, data[:end - cut]))


CORRUPTIONS = {
    "empty file": lambda: b"",
    "not gguf": lambda: b"PK\x03\x04" + b"\0" * 100,
    "bad version": lambda: craft(version=99),
    "version 1": lambda: craft(version=1),
    "truncated header": lambda: craft()[:30],
    "truncated data": lambda: craft()[:-8],
    "huge tensor count": lambda: craft(tensor_count=2**60),
    "huge kv count": lambda: craft(kv_count=2**40),
    "string past end": lambda: craft(kv=[("k", 8, struct.pack("<Q", 2**50))]),
    "unknown value type": lambda: craft(kv=[("k", 77, b"\0" * 8)]),
    "invalid utf-8 key": lambda: craft(kv=[(b"\xff\xfe".decode("latin-1"), 4, struct.pack("<I", 1))]).replace(
        b"\xc3\xbf\xc3\xbe", b"\xff\xfe\xff\xfe"),
    "duplicate key": lambda: craft(kv=[("k", 4, struct.pack("<I", 1))] * 2),
    "bad alignment": lambda: craft(kv=[("general.alignment", 4, struct.pack("<I", 24))], alignment=24),
    "misaligned offset": lambda: craft(tensors=[("w", [32], int(GGMLType.F32), 4)]),
    "tensor past end": lambda: craft(tensors=[("w", [32, 200], int(GGMLType.F32), 0)]),
    "unknown tensor type": lambda: craft(tensors=[("w", [32, 2], 250, 0)]),
    "partial block": lambda: craft(tensors=[("w", [33, 2], int(GGMLType.Q8_0), 0)]),
    "zero dimension": lambda: craft(tensors=[("w", [32, 0], int(GGMLType.F32), 0)]),
    "too many dims": lambda: craft(tensors=[("w", [1, 1, 1, 1, 2], int(GGMLType.F32), 0)]),
    "overlapping tensors": lambda: craft(tensors=[("a", [32], int(GGMLType.F32), 0), ("b", [32], int(GGMLType.F32), 32)]),
    "duplicate tensor": lambda: craft(tensors=[("a", [16], int(GGMLType.F32), 0), ("a", [16], int(GGMLType.F32), 64)]),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_corrupt_file_raises_model_format_error_naming_file(tmp_path, case):
    path = _write(tmp_path, CORRUPTIONS[case]())
    with pytest.raises(ModelFormatError) as excinfo:
        open_gguf(path)
    assert str(path) in str(excinfo.value)


def test_missing_file(tmp_path):
    with pytest.raises(ModelFormatError, match="no such file"):
        open_gguf(tmp_path / "absent.gguf")


def test_random_bit_flips_in_header_never_crash(tmp_path, smollm2_path, string_walk):
    """Flip bits anywhere in the metadata/tensor-info region of the real model: the reader
    either still loads a consistent file or raises ModelFormatError — nothing else."""
    with open_gguf(smollm2_path) as f:
        header_end = f.data_offset
    original = smollm2_path.read_bytes()[: header_end + 4096]  # header + a little data
    rng = random.Random(1234)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(150):
        corrupt = bytearray(original)
        for _ in range(rng.randint(1, 4)):
            # bias towards the small numeric fields at the very start and the tensor infos
            pos = rng.choice([rng.randrange(0, 64), rng.randrange(0, header_end)])
            corrupt[pos] ^= 1 << rng.randrange(8)
        path = _write(tmp_path, bytes(corrupt))
        try:
            open_gguf(path).close()
            outcomes["ok"] += 1
        except ModelFormatError:
            outcomes["error"] += 1
    # truncating to header+4 KiB alone already makes most tensors fall off the end
    assert outcomes["error"] > 0


def test_real_models_parse(smollm2_path, gemma3_path):
    with open_gguf(smollm2_path) as f:
        assert f.metadata["general.architecture"] == "llama"
        assert f.tensors["token_embd.weight"].shape == (49152, 576)
        assert f.tensors["blk.0.attn_q.weight"].type_name == "Q4_1"
    with open_gguf(gemma3_path) as f:
        assert f.metadata["general.architecture"] == "gemma3"
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 262144


def test_packed_strings_round_trip_and_refuse_bad_offsets():
    import numpy as np

    from edgellm.io.strings import StringArray, pack_strings

    words = ["héllo", "", "wörld", "😀"]
    blob, offsets = pack_strings(words)
    assert list(StringArray.from_packed(blob, offsets)) == words
    assert pack_strings(StringArray.from_packed(blob, offsets))[0] == blob
    for bad_blob, bad_offsets in [(blob, offsets[:-1]),                 # does not reach the end
                                  (blob, offsets[::-1].copy()),         # falling
                                  (blob, np.array([0, 2, len(blob)])),  # splits the é
                                  (b"\xff", np.array([0, 1]))]:         # not UTF-8
        with pytest.raises(ValueError):
            StringArray.from_packed(bad_blob, bad_offsets)


def test_native_utf8_check_agrees_with_pythons_decoder():
    """Random byte strings made of the bytes UTF-8's edge cases hinge on (overlong leads,
    surrogates, past U+10FFFF, stray continuations, cut sequences): the native check and
    Python's decoder call the same ones well-formed."""
    from edgellm.kernels.scan import first_bad_utf8

    rng = np.random.default_rng(0)
    edges = np.array([0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1,
                      0xEC, 0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFF], np.uint8)
    strings = [bytes(rng.choice(edges, size=int(rng.integers(0, 6)))) for _ in range(20000)]
    strings += [s.encode() for s in ["é", "€", "😀", "\U0010FFFF", "\uD7FF", "\uE000"]]
    for s in strings:
        buf = np.frombuffer(s + b"!", np.uint8)  # never empty
        try:
            s.decode("utf-8")
            valid = True
        except UnicodeDecodeError:
            valid = False
        assert first_bad_utf8(buf, np.array([[0, len(s)]])) == (-1 if valid else 0), s
