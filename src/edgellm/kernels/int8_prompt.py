"""A prompt's GEMMs in 8-bit integers on CPUs without native bf16 (int8_gemm.c: `vpmaddubsw`, `vpdpbusd`
with AVX-VNNI or, in zmm, AVX512-VNNI, NEON's `sdot`; the same integers): the weights multiplied exactly as the model holds them
(4-bit I4R64 codes, Q5_0 values in Q8R16 blocks, a file's Q6_K blocks), the activations rounded to int8 per token and group
of 32, except each token's OUTLIERS largest values, which are multiplied in fp32 beside. A token's
result depends on its own activations only, whatever else shares the call.

One `Int8Prompt` quantizes a linear's input once for all of its weights (fused parts, row chunks)."""
from __future__ import annotations

import ctypes

import numpy as np

from edgellm.extras import torch

from edgellm import threads
from edgellm.kernels.build import library, profiled
from edgellm.kernels.buffers import address, as_array
from edgellm.kernels.prompt import scratch

GROUP = 32  # k per activation / weight group (int8_gemm.c)
STRIP = 16  # rows per packed strip
# Each token's largest activations, multiplied in fp32: SmolLM2's prompt KL against transformers
# 2.8e-3 with none kept, 9.6e-4 with 2, 8.2e-4 with 4, 7.3e-4 with 8 (emulated; int16 activations: 1.3e-4)
OUTLIERS = 8


def int8_gemm_native(lib: ctypes.CDLL | None = None) -> bool:
    """Whether this build has the 8-bit prompt GEMM (the avx2, avx512 and neon variants; it runs where
    the prompt GEMMs would be fp32, i.e. without native bf16)."""
    lib = lib or library()
    return lib is not None and bool(lib.edgellm_int8_gemm_native())


def int8_takes_i4r64(n: int, k: int, group: int, planes: int, lib: ctypes.CDLL | None = None) -> bool:
    """Whether an (n, k) I4R64 weight goes to the int8 GEMM: one plane of 4-bit codes, groups of 32."""
    return planes == 1 and group == GROUP and k % GROUP == 0 and n % 64 == 0 and int8_gemm_native(lib)


class Int8Prompt:
    """x (T, K) fp32, quantized once (int8_gemm.c), times the weights of one linear. The quantized rows live
    in this thread's scratch: an Int8Prompt is good until the thread makes its next one."""

    def __init__(self, x: torch.Tensor, lib: ctypes.CDLL | None = None):
        self.lib = lib or library()
        if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] % GROUP:
            raise ValueError(f"Int8Prompt takes fp32 (T, K) activations with K % {GROUP} == 0, got {x.dtype} "
                             f"{tuple(x.shape)}")
        x = x.contiguous()
        self.t, self.k = x.shape
        self.threads, r = threads.current(), min(OUTLIERS, self.k)
        self.act = scratch(self.lib.edgellm_int8_act_bytes(self.t, self.k), torch.uint8, "int8 activations")
        self.at = torch.empty(self.t, r, dtype=torch.int32)  # each token's outliers, as indices into channels
        self.values = torch.empty(self.t, r, dtype=torch.float32)
        channels = torch.empty(self.k, dtype=torch.int32)
        with profiled("edgellm::int8_quantize"):
            u = self.lib.edgellm_int8_quantize(x.data_ptr(), self.t, self.k, r, self.act.data_ptr(), self.at.data_ptr(),
                                               self.values.data_ptr(), channels.data_ptr(), self.threads)
        self.channels = channels[:u]  # every channel some token left out: the weight columns the GEMM reads

    def _panel(self, n: int) -> torch.Tensor:
        return scratch(self.lib.edgellm_int8_panel_bytes(n, self.k), torch.uint8, "int8 panel")

    def _times(self, panel: torch.Tensor, n: int, bits: int, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            out = torch.empty(self.t, n, dtype=torch.float32)
        elif out.shape != (self.t, n) or out.dtype != torch.float32 or out.stride(1) != 1:
            raise ValueError(f"out must be an fp32 ({self.t}, {n}) tensor with contiguous rows")
        with profiled("edgellm::int8_gemm"):
            self.lib.edgellm_int8_gemm(self.act.data_ptr(), self.t, self.k, panel.data_ptr(), n, bits, out.data_ptr(),
                                       out.stride(0), self.channels.data_ptr(), len(self.channels), self.at.data_ptr(),
                                       self.values.data_ptr(), self.at.shape[1], self.threads)
        return out

    def times_i4r64(self, packed: torch.Tensor, scale_zero: torch.Tensor, rows: tuple[int, int],
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """(T, end - start): rows [start, end) (multiples of 64) of an I4R64 weight (one plane, groups of 32);
        into `out` (a view with contiguous rows: a slice of a wider output) where given."""
        n, k = packed.shape[0], packed.shape[1] * 2
        start, end = rows
        if k != self.k or start % 64 or end % 64 or not 0 <= start < end <= n:
            raise ValueError(f"rows [{start}, {end}) of an ({n}, {k}) I4R64 weight do not fit K = {self.k}")
        panel = self._panel(end - start)
        with profiled("edgellm::int8_pack"):
            self.lib.edgellm_int8_pack_i4r64(address(packed), address(scale_zero), n, k, start, end - start,
                                             panel.data_ptr(), self.threads)
        return self._times(panel, end - start, 4, out)

    def times_q5_0(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(T, N): N rows of Q8R16 blocks holding Q5_0 values (-16..15; quant/blocks.py's widened Q5_0); into
        `out` as times_i4r64."""
        n = rows.shape[0]
        if as_array(rows).dtype != np.uint8 or n % STRIP or rows.shape[1] != self.k // 32 * 34:
            raise ValueError(f"Q8R16 rows for K = {self.k} must be ({n}, {self.k // 32 * 34}) uint8, N % {STRIP} == 0")
        rows, panel = np.ascontiguousarray(as_array(rows)), self._panel(n)
        with profiled("edgellm::int8_pack"):
            self.lib.edgellm_int8_pack_q8r16(rows.ctypes.data, n, self.k, panel.data_ptr(), self.threads)
        return self._times(panel, n, 5, out)

    def times_q6_k(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(T, N): N rows of a GGUF file's Q6_K blocks (K % 256 == 0, N % 16 == 0); into `out` as times_i4r64."""
        n = rows.shape[0]
        if as_array(rows).dtype != np.uint8 or n % STRIP or self.k % 256 or rows.shape[1] != self.k // 256 * 210:
            raise ValueError(f"Q6_K rows for K = {self.k} must be ({n}, {self.k // 256 * 210}) uint8, N % {STRIP} == 0, "
                             f"K % 256 == 0")
        rows, panel = np.ascontiguousarray(as_array(rows)), self._panel(n)
        with profiled("edgellm::int8_pack"):
            self.lib.edgellm_int8_pack_q6_k(rows.ctypes.data, n, self.k, panel.data_ptr(), self.threads)
        return self._times(panel, n, 6, out)
