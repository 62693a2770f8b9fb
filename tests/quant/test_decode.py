"""The native Llama decode step (kernels/decode.py + llama_layer.c) against the model's own
PyTorch layers on the same weights and the same native GEMV: same logits, same tokens."""
from __future__ import annotations

import pytest
import torch

import edgellm
from edgellm import kernels
from edgellm.kernels.decode import fused_step
from edgellm.kv import KVConfig

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs AVX-512 VNNI and a C compiler")


def _decode_logits(model, ids: list[int], steps: int, fused: bool) -> list[torch.Tensor]:
    net = model.net
    if not fused:
        net.__dict__["_fused"] = None  # the PyTorch path
    seq, _ = model.kv.new_sequence()
    out = []
    with torch.inference_mode():
        seq.prepare(len(ids))
        logits = net(torch.tensor([ids]), seq, last_only=True)
        for _ in range(steps):
            token = int(logits[0, -1].argmax())
            seq.prepare(1)
            if fused:  # straight to the native step, which must take this case
                logits = fused_step(net, torch.tensor([[token]]), seq)
                assert logits is not None
            else:
                logits = net(torch.tensor([[token]]), seq, last_only=True)
            out.append(logits[0, -1])
    seq.release()
    net.__dict__.pop("_fused", None)
    return out


# Gemma's looser bound: PyTorch rounds the inputs of its dense bf16 linears, the C layer keeps
# fp32 (measured 0.1-0.7 % of the largest logit). 600 tokens: Gemma's 512-slot sliding rings wrap
# around. KV in fp16 (the default) and fp32: the C layer stores and reads both.
@pytest.mark.parametrize("name, repeats, tolerance, kv", [("smollm2_path", 6, 1e-3, "f16"), ("gemma3_path", 6, 1e-2, "f16"),
                                                          ("gemma3_path", 60, 1e-2, "f16"), ("smollm2_path", 6, 1e-3, "f32"),
                                                          ("gemma3_path", 60, 1e-2, "f32")])
def test_fused_decode_matches_pytorch_layers(name, repeats, tolerance, kv, request):
    with edgellm.load(request.getfixturevalue(name), kv=KVConfig(k_precision=kv, v_precision=kv)) as model:
        ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * repeats)
        fused = _decode_logits(model, ids, 16, fused=True)
        plain = _decode_logits(model, ids, 16, fused=False)
    for a, b in zip(fused, plain):
        assert (a - b).abs().max() < tolerance * b.abs().max()
        assert int(a.argmax()) == int(b.argmax())


def test_other_kv_layouts_keep_the_pytorch_path(smollm2_path):
    with edgellm.load(smollm2_path, kv=KVConfig(k_precision="int8", v_precision="int8")) as model:
        seq, _ = model.kv.new_sequence()
        assert fused_step(model.net, torch.tensor([[1]]), seq) is None  # int8 KV: not ours
        seq.release()
        done = model.generate("Hello", max_tokens=4, ignore_eos=True)
        assert len(done.token_ids) == 4
