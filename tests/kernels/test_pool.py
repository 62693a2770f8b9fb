"""The kernels' threads (pool.c): the decode kernels on edgellm's own pool, shared by every calling
thread; the prompt kernels on the caller's OpenMP team, or on the pool where the compiler has no
OpenMP. Also the native greedy argmax, which keeps torch's OpenMP team out of a decode step."""
from __future__ import annotations

import multiprocessing
import stat
import subprocess
import threading

import pytest
import torch
import torch.nn.functional as F

from edgellm import kernels
from edgellm.generation.sampling import greedy
from edgellm.kernels.build import _sources, build, compiler, load
from edgellm.kernels.isa import selected
from tests.kernels.test_gemv import _int4


def _gemv(lib, x, packed, pairs):
    return kernels.int4_gemv(x, packed, pairs, 32, 1, lib=lib)


def test_decode_kernels_called_from_several_threads_at_once_give_the_serial_results(lib):
    packed, pairs, _ = _int4(960, 576, 1, 32)
    inputs = [torch.randn(m, 576, generator=torch.Generator().manual_seed(m)) for m in (1, 2, 4, 8)]
    expected = [_gemv(lib, x, packed, pairs) for x in inputs]
    results: dict[int, list[torch.Tensor]] = {}

    def call(i: int) -> None:  # each thread its own input, 50 calls interleaved with the others'
        results[i] = [_gemv(lib, inputs[i], packed, pairs) for _ in range(50)]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller never returned: the pool deadlocked"
    for i, outs in results.items():
        assert all(torch.equal(out, expected[i]) for out in outs)
    assert len(results) == len(inputs)


def test_shares_whose_workers_lose_their_cores_give_the_serial_results():
    """After each of torch's parallel ops its OpenMP threads spin on (~20 ms), so the pool's worker
    often has no core when a job comes: the caller then runs the worker's share too, and a worker
    that wakes late must not run a share of a job that has moved on (it once did: a wrong body, a
    crash in ~1 process of 6). The pool's code is the same in every variant: the machine's is tested."""
    lib = kernels.library()
    packed, pairs, _ = _int4(128, 64, 1, 32)  # two 64-row blocks: a share per thread, microseconds a call
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))
    expected = _gemv(lib, x, packed, pairs)
    big = torch.randn(1 << 20)
    wrong = 0
    for i in range(10_000):
        if i % 30 == 0:
            torch.tanh(big)  # an OpenMP region: its threads spin on after it
        wrong += not torch.equal(_gemv(lib, x, packed, pairs), expected)
    assert wrong == 0


def _child_gemv(conn, packed, pairs, x) -> None:
    conn.send(_gemv(kernels.library(), x, packed, pairs).tolist())  # plain floats: no shared memory


def test_a_forked_child_starts_its_own_workers():
    # the parent's workers are not copied by fork(): the child must not wait on them forever
    if kernels.library() is None:
        pytest.skip("no native kernels here")
    packed, pairs, _ = _int4(960, 576, 1, 32)
    x = torch.randn(4, 576)
    parent = _gemv(kernels.library(), x, packed, pairs)  # the parent's pool is running
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child_gemv, args=(send, packed, pairs, x))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung in the kernel")
    assert child.exitcode == 0 and receive.recv() == parent.tolist()


def test_without_openmp_the_prompt_kernels_run_on_the_pool(tmp_path):
    real = compiler()
    if real is None:
        pytest.skip("no C compiler")
    cc = tmp_path / "cc-without-openmp"  # a compiler that rejects -fopenmp, as some slim toolchains do
    cc.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {real} "$@"\n')
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    target = tmp_path / "no-openmp.so"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CC", str(cc))
        build(_sources(), selected().compiler_flags(), target)
    symbols = subprocess.run(["nm", "-D", "--undefined-only", str(target)], capture_output=True, text=True)
    if symbols.returncode == 0:
        assert "GOMP_" not in symbols.stdout and "omp_" not in symbols.stdout
    lib = load(target)
    x, weight = torch.randn(37, 640), torch.rand(640) + 0.5
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6, torch.float32, lib=lib),
                               F.rms_norm(x, (640,), weight, 1e-6), atol=1e-5, rtol=1e-5)
    packed, pairs, w = _int4(960, 576, 1, 32)
    y = torch.randn(4, 576)
    torch.testing.assert_close(_gemv(lib, y, packed, pairs).double(), y.double() @ w.T, atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("n", [1, 17, 1024, 1025, 49152, 262145])
def test_native_greedy_is_torchs_first_argmax(n):
    if kernels.library() is None:
        pytest.skip("no native kernels here")
    g = torch.Generator().manual_seed(n)
    logits = torch.randn(n, generator=g)
    assert greedy(logits) == int(logits.argmax())
    logits[n // 3] = logits[-1] = logits.max() + 1  # a tie: the first maximum wins
    assert greedy(logits) == n // 3
    masked = torch.full((n,), float("-inf"))
    masked[n - 1] = -1e30
    assert greedy(masked) == n - 1


def test_greedy_of_a_strided_or_half_tensor_takes_torchs_path():
    logits = torch.randn(4096, 2)[:, 0]  # not contiguous: the kernel would read the wrong floats
    assert greedy(logits) == int(logits.argmax())
    half = torch.randn(4096).bfloat16()
    assert greedy(half) == int(half.argmax())
