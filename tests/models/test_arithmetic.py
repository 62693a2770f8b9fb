"""Arithmetic follows the hardware: on a CPU without native bf16 (here: the avx2 or scalar variant,
as on a Zen 3 or any ARM board without BF16), fast mode never hands PyTorch a bf16 matmul — its
bf16 GEMM runs ~90x slower than fp32 there. Every matmul-like op of a prompt, a decode step, a
batched decode step and a quantized-KV decode is recorded and checked."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edgellm import kernels

SCRIPT = r"""
import sys, torch
from torch.utils._python_dispatch import TorchDispatchMode
import edgellm
from edgellm.kv import KVConfig

MATMULS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_weight_int4pack_mm", "_weight_int8pack_mm",
           "_scaled_dot_product", "convolution")

class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if any(name.startswith(m) for m in MATMULS):
            dtypes = {str(a.dtype) for a in args if isinstance(a, torch.Tensor)}
            self.seen.append((name, tuple(sorted(dtypes))))
        return func(*args, **(kwargs or {}))

from edgellm import kernels
with Recorder() as control:  # the recorder sees a bf16 matmul when there is one
    torch.mm(torch.ones(2, 2, dtype=torch.bfloat16), torch.ones(2, 2, dtype=torch.bfloat16))
assert control.seen == [("mm.default", ("torch.bfloat16",))], control.seen

recorder = Recorder()
model = edgellm.load(sys.argv[1], kv=KVConfig(k_precision="int8", v_precision="int4"))
prompt = "The quick brown fox jumps over the lazy dog. " * 6  # more rows than the GEMV path takes
with recorder:
    model.generate(prompt, max_tokens=3, ignore_eos=True)
from edgellm.serving.service import Service
service = Service(model, max_batch=4)
with recorder:
    for session in [service.init(temperature=0) for _ in range(2)]:
        list(session.infer("Hi there"))
print(kernels.selected().label, kernels.compute_dtype(), len(recorder.seen), kernels.describe().endswith("int8 prompt GEMMs"))
for name, dtypes in recorder.seen:
    print(name, *dtypes)
"""


def _bf16_free_variant() -> str:
    names = [v.label for v in kernels.runnable() if not v.bf16]
    return "avx2" if "avx2" in names else names[0]  # scalar is always there


@pytest.mark.parametrize("model", ["smollm2_path", "gemma3_path"])
def test_no_bf16_matmul_without_native_bf16(model, request):
    path = request.getfixturevalue(model)
    variant = _bf16_free_variant()
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "EDGELLM_ISA": variant})
    assert done.returncode == 0, done.stderr[-3000:]
    header, *ops = done.stdout.splitlines()
    label, dtype, count, int8 = header.split()
    assert [label, dtype] == [variant, "torch.float32"]
    # the prompts did reach PyTorch's GEMM, unless the int8 one took all of them (plain AVX2, SmolLM2)
    assert int8 == "True" or (int(count) > 0 and ops)
    assert not [op for op in ops if "bfloat16" in op], ops
