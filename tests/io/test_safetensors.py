from __future__ import annotations

import json
import struct

import pytest
import torch

from edgellm.errors import ModelFormatError
from edgellm.io.safetensors import PAD_PREFIX, SafetensorsFile, write_safetensors


def test_written_files_are_aligned_standard_safetensors(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a": torch.arange(3, dtype=torch.int8), "b": torch.randn(5, 7).bfloat16(),
               "c": torch.randn(4), "d": torch.zeros(0, dtype=torch.uint8)}
    path = tmp_path / "x.safetensors"
    write_safetensors(path, tensors, {"k": "v"})
    theirs = load_file(str(path))  # the reference library reads it
    with SafetensorsFile(path) as ours:
        assert ours.metadata == {"k": "v"}
        for name, t in tensors.items():
            assert torch.equal(theirs[name], t) and torch.equal(ours.tensor(name), t)
            assert ours.entries[name].offset % 64 == 0 or t.numel() == 0
        assert all(n in tensors or n.startswith(PAD_PREFIX) for n in ours.entries)


def _write_raw(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("header, data, problem", [
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "truncated"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16, "do not hold"),
    ({"a": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16, "malformed"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 16, "overlap"),
])
def test_damaged_headers_are_refused(tmp_path, header, data, problem):
    path = tmp_path / "bad.safetensors"
    _write_raw(path, header, data)
    with pytest.raises(ModelFormatError, match=problem):
        SafetensorsFile(path)


def test_garbage_and_empty_files_are_refused(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "junk").write_bytes(struct.pack("<Q", 5) + b"{nope")
    (tmp_path / "huge").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    for name in ("empty", "junk", "huge"):
        with pytest.raises(ModelFormatError):
            SafetensorsFile(tmp_path / name)
