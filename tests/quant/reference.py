"""Independent scalar reference for GGML block formats: pure Python, one block at
a time, written from the format definitions. Deliberately shares no code with
edgellm.quant so a mistake in one cannot hide in the other.

Each float32 operation of ggml's dequantizer is rounded to float32 here (`_f32`),
so results should agree with a float32 implementation to the last bit.
"""
from __future__ import annotations

import random
import struct

# name -> (elements per block, bytes per block)
SIZES: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "IQ4_NL": (32, 18),
}


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _half(block: bytes, offset: int) -> float:
    return struct.unpack_from("<e", block, offset)[0]


# ---------------------------------------------------------------- decoders


def _dec_f32(b: bytes) -> list[float]:
    return [struct.unpack("<f", b)[0]]


def _dec_f16(b: bytes) -> list[float]:
    return [_half(b, 0)]


def _dec_bf16(b: bytes) -> list[float]:
    # bf16 is the upper half of a float32
    return [struct.unpack("<f", b"\x00\x00" + b)[0]]


def _dec_q4_0(b: bytes) -> list[float]:
    d, qs = _half(b, 0), b[2:18]
    y = [0.0] * 32
    for j in range(16):
        y[j] = _f32(((qs[j] & 0xF) - 8) * d)
        y[j + 16] = _f32(((qs[j] >> 4) - 8) * d)
    return y


_IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _dec_iq4_nl(b: bytes) -> list[float]:
    d, qs = _half(b, 0), b[2:18]
    y = [0.0] * 32
    for j in range(16):
        y[j] = _f32(_IQ4_NL_LEVELS[qs[j] & 0xF] * d)
        y[j + 16] = _f32(_IQ4_NL_LEVELS[qs[j] >> 4] * d)
    return y


def _dec_q4_1(b: bytes) -> list[float]:
    d, m, qs = _half(b, 0), _half(b, 2), b[4:20]
    y = [0.0] * 32
    for j in range(16):
        y[j] = _f32(_f32((qs[j] & 0xF) * d) + m)
        y[j + 16] = _f32(_f32((qs[j] >> 4) * d) + m)
    return y


def _dec_q5_0(b: bytes) -> list[float]:
    d = _half(b, 0)
    (qh,) = struct.unpack_from("<I", b, 2)
    qs = b[6:22]
    y = [0.0] * 32
    for j in range(16):
        x0 = (qs[j] & 0xF) | (((qh >> j) & 1) << 4)
        x1 = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)
        y[j] = _f32((x0 - 16) * d)
        y[j + 16] = _f32((x1 - 16) * d)
    return y


def _dec_q5_1(b: bytes) -> list[float]:
    d, m = _half(b, 0), _half(b, 2)
    (qh,) = struct.unpack_from("<I", b, 4)
    qs = b[8:24]
    y = [0.0] * 32
    for j in range(16):
        x0 = (qs[j] & 0xF) | (((qh >> j) & 1) << 4)
        x1 = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)
        y[j] = _f32(_f32(x0 * d) + m)
        y[j + 16] = _f32(_f32(x1 * d) + m)
    return y


def _dec_q8_0(b: bytes) -> list[float]:
    d = _half(b, 0)
    qs = struct.unpack_from("<32b", b, 2)
    return [_f32(q * d) for q in qs]


def _scale_min_k4(j: int, s: bytes) -> tuple[int, int]:
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
    return sc, m


def _dec_q4_k(b: bytes) -> list[float]:
    d, dmin, scales, qs = _half(b, 0), _half(b, 2), b[4:16], b[16:144]
    y = [0.0] * 256
    for c in range(4):
        sc1, m1 = _scale_min_k4(2 * c, scales)
        sc2, m2 = _scale_min_k4(2 * c + 1, scales)
        d1, dm1 = _f32(d * sc1), _f32(dmin * m1)
        d2, dm2 = _f32(d * sc2), _f32(dmin * m2)
        for l in range(32):
            q = qs[32 * c + l]
            y[64 * c + l] = _f32(_f32(d1 * (q & 0xF)) - dm1)
            y[64 * c + 32 + l] = _f32(_f32(d2 * (q >> 4)) - dm2)
    return y


def _dec_q5_k(b: bytes) -> list[float]:
    d, dmin, scales = _half(b, 0), _half(b, 2), b[4:16]
    qh, qs = b[16:48], b[48:176]
    y = [0.0] * 256
    for c in range(4):
        sc1, m1 = _scale_min_k4(2 * c, scales)
        sc2, m2 = _scale_min_k4(2 * c + 1, scales)
        d1, dm1 = _f32(d * sc1), _f32(dmin * m1)
        d2, dm2 = _f32(d * sc2), _f32(dmin * m2)
        for l in range(32):
            q = qs[32 * c + l]
            lo = (q & 0xF) + (16 if qh[l] & (1 << (2 * c)) else 0)
            hi = (q >> 4) + (16 if qh[l] & (1 << (2 * c + 1)) else 0)
            y[64 * c + l] = _f32(_f32(d1 * lo) - dm1)
            y[64 * c + 32 + l] = _f32(_f32(d2 * hi) - dm2)
    return y


def _dec_q6_k(b: bytes) -> list[float]:
    ql_all, qh_all = b[0:128], b[128:192]
    sc_all = struct.unpack_from("<16b", b, 192)
    d = _half(b, 208)
    y = [0.0] * 256
    for h in range(2):
        ql, qh, sc = ql_all[64 * h :], qh_all[32 * h :], sc_all[8 * h :]
        base = 128 * h
        for l in range(32):
            i = l // 16
            q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32
            y[base + l] = _f32(_f32(d * sc[i]) * q1)
            y[base + l + 32] = _f32(_f32(d * sc[i + 2]) * q2)
            y[base + l + 64] = _f32(_f32(d * sc[i + 4]) * q3)
            y[base + l + 96] = _f32(_f32(d * sc[i + 6]) * q4)
    return y


_DECODERS = {
    "F32": _dec_f32,
    "F16": _dec_f16,
    "BF16": _dec_bf16,
    "Q4_0": _dec_q4_0,
    "IQ4_NL": _dec_iq4_nl,
    "Q4_1": _dec_q4_1,
    "Q5_0": _dec_q5_0,
    "Q5_1": _dec_q5_1,
    "Q8_0": _dec_q8_0,
    "Q4_K": _dec_q4_k,
    "Q5_K": _dec_q5_k,
    "Q6_K": _dec_q6_k,
}


def decode(fmt: str, data: bytes) -> list[float]:
    """Dequantize a whole byte string of `fmt` blocks, block by block."""
    _, nbytes = SIZES[fmt]
    if len(data) % nbytes:
        raise ValueError("not a whole number of blocks")
    out: list[float] = []
    for start in range(0, len(data), nbytes):
        out.extend(_DECODERS[fmt](data[start : start + nbytes]))
    return out


# ---------------------------------------------------------------- encoders


def _rand_half(rng: random.Random) -> bytes:
    # Finite, modest scales: random bytes could be inf/NaN and hide mismatches.
    return struct.pack("<e", rng.uniform(-2.0, 2.0))


def random_block(fmt: str, rng: random.Random) -> bytes:
    """One valid random block of `fmt`: random quants, finite fp16 scales."""
    if fmt == "F32":
        return struct.pack("<f", rng.uniform(-10.0, 10.0))
    if fmt == "F16":
        return _rand_half(rng)
    if fmt == "BF16":
        return struct.pack("<f", rng.uniform(-10.0, 10.0))[2:4]
    if fmt in ("Q4_0", "IQ4_NL"):
        return _rand_half(rng) + rng.randbytes(16)
    if fmt in ("Q4_1", "Q5_1"):
        body = rng.randbytes(16 if fmt == "Q4_1" else 20)  # [qh u32 +] qs
        return _rand_half(rng) + _rand_half(rng) + body
    if fmt == "Q5_0":
        return _rand_half(rng) + rng.randbytes(20)
    if fmt == "Q8_0":
        return _rand_half(rng) + rng.randbytes(32)
    if fmt in ("Q4_K", "Q5_K"):
        body = rng.randbytes(12 + (128 if fmt == "Q4_K" else 160))  # scales [+ qh] + qs
        return _rand_half(rng) + _rand_half(rng) + body
    if fmt == "Q6_K":
        return rng.randbytes(128 + 64 + 16) + _rand_half(rng)
    raise ValueError(f"no encoder for {fmt}")


def random_tensor(fmt: str, n_elements: int, rng: random.Random) -> bytes:
    """Bytes of a random tensor with n_elements (a whole number of blocks)."""
    elems, _ = SIZES[fmt]
    if n_elements % elems:
        raise ValueError("not a whole number of blocks")
    return b"".join(random_block(fmt, rng) for _ in range(n_elements // elems))
