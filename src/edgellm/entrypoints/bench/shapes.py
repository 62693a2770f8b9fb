"""Random-weight GGUF models of the shapes people deploy (0.5B–8B), for timing at real size.

A model's speed does not depend on the values of its weights, only on its shapes and weight
types, so a file with the exact tensor shapes of Qwen2.5-1.5B and random codes decodes, prefills
and loads as the real one does. The base file is written here as Q8_0 (random codes, one scale
per block: no float weights are ever made, so an 8B model is written in seconds); the other
types are llama.cpp's own quantizer run on it (`llama_model_quantize`, the `bench` extra), so
both engines read the very bytes a downloaded file would hold. Files are cached by shape and
type under the edgellm cache.

What is left out, because speed does not see it: the tokenizer (a byte vocabulary padded to the
real vocabulary size: the embedding and head keep their real shapes) and Llama 3's RoPE
frequency scaling (its base frequency is kept)."""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from edgellm import families
from edgellm.atomic import atomic_path
from edgellm.errors import EdgeLLMError
from edgellm.registry import cache_dir


@dataclass(frozen=True)
class Shape:
    arch: str  # the GGUF architecture name
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = True
    rope_base: float = 1e6
    context: int = 32_768
    sliding_window: int = 0  # Gemma 3: five sliding layers to one global


# From each model's Hugging Face config.json.
SHAPES: dict[str, Shape] = {
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 64, 4864, 151_936),
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128_256, rope_base=500_000.0, context=131_072),
    "gemma-3-1b": Shape("gemma3", 1152, 26, 4, 1, 256, 6912, 262_144, sliding_window=512),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 128, 8960, 151_936),
    "qwen2.5-3b": Shape("qwen2", 2048, 36, 16, 2, 128, 11_008, 151_936),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 128, 8192, 128_256, rope_base=500_000.0, context=131_072),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 128, 18_944, 152_064, tied=False),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 128, 14_336, 128_256, tied=False, rope_base=500_000.0,
                          context=131_072),
}

# llama.cpp's file types (enum llama_ftype) for the quantizations people download.
LLAMA_FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
WEIGHT_TYPES = tuple(LLAMA_FTYPES)

Q8_0_BLOCK, Q8_0_BLOCK_BYTES = 32, 34
_RANDOM_CHUNK = 1 << 26  # bytes of random codes made at a time


def tensor_shapes(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names and (rows, columns) shapes, as llama.cpp's converter writes them."""
    h = shape.hidden
    out = [("token_embd.weight", (shape.vocab, h)), ("output_norm.weight", (h,))]
    if not shape.tied:
        out.append(("output.weight", (shape.vocab, h)))
    family = families.get(shape.arch)
    for i in range(shape.layers):
        out += family.block_tensors(i, h, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn)
    return out


def parameter_count(shape: Shape) -> int:
    return sum(int(np.prod(dims)) for _, dims in tensor_shapes(shape))


def model_path(name: str, weight_type: str) -> Path:
    return cache_dir() / "shapes" / f"{name}-random-{weight_type}.gguf"


def check_names(shapes: list[str], weight_types: list[str]) -> None:
    for name in shapes:
        if name not in SHAPES:
            raise EdgeLLMError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    for weight_type in weight_types:
        if weight_type not in LLAMA_FTYPES:
            raise EdgeLLMError(f"unknown weight type {weight_type!r}; known: {', '.join(LLAMA_FTYPES)}")


def ensure_model(name: str, weight_type: str, progress=lambda line: None) -> Path:
    """The cached random-weight file of shape `name` in `weight_type`, made first when missing."""
    check_names([name], [weight_type])
    path = model_path(name, weight_type)
    if path.exists():
        return path
    base = model_path(name, "Q8_0")
    if not base.exists():
        progress(f"writing {base.name} (random Q8_0 codes, {parameter_count(SHAPES[name]) / 1e9:.2f}B parameters) ...")
        write_random_q8_0(base, SHAPES[name])
    if weight_type != "Q8_0":
        progress(f"quantizing it to {weight_type} with llama.cpp's quantizer ...")
        quantize_with_llama_cpp(base, path, weight_type)
    return path


def write_random_q8_0(path: Path, shape: Shape, seed: int = 0,
                     blocks: dict[str, tuple[np.ndarray, int]] | None = None) -> Path:
    """Write a GGUF of `shape` whose matrices are random Q8_0 blocks (weights of std ~0.02), except
    those `blocks` gives: name -> (rows of raw blocks as uint8, their ggml type number)."""
    import gguf

    blocks = blocks or {}
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = tensor_shapes(shape)
    with atomic_path(path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), shape.arch)
        _write_metadata(writer, shape)
        for name, dims in tensors:
            if name in blocks:
                raw, ggml_type = blocks[name]
                writer.add_tensor_info(name, raw.shape, raw.dtype, raw.nbytes, raw_dtype=gguf.GGMLQuantizationType(ggml_type))
            elif len(dims) == 1:
                writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
            else:
                rows, cols = dims
                nbytes = rows * cols // Q8_0_BLOCK * Q8_0_BLOCK_BYTES
                writer.add_tensor_info(name, (rows, cols // Q8_0_BLOCK * Q8_0_BLOCK_BYTES), np.dtype(np.uint8),
                                       nbytes, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, dims in tensors:
            data = (blocks[name][0] if name in blocks else _random_vector(rng, dims[0]) if len(dims) == 1
                    else _random_q8_0(rng, *dims))
            writer.write_tensor_data(data)
        writer.close()
    return path


def _random_vector(rng: np.random.Generator, n: int) -> np.ndarray:
    """Norm weights and biases near one and zero, as trained ones are."""
    return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def _random_q8_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Q8_0 blocks of uniform random codes whose scale makes the weights' std about 0.02."""
    blocks = rows * cols // Q8_0_BLOCK
    out = np.empty((blocks, Q8_0_BLOCK_BYTES), np.uint8)
    out[:, :2] = np.frombuffer(np.float16(0.02 * 3**0.5 / 127).tobytes(), np.uint8)
    step = max(1, _RANDOM_CHUNK // Q8_0_BLOCK)
    for start in range(0, blocks, step):
        stop = min(blocks, start + step)
        out[start:stop, 2:] = np.frombuffer(rng.bytes((stop - start) * Q8_0_BLOCK), np.uint8).reshape(-1, Q8_0_BLOCK)
    return out.reshape(rows, -1)


def _write_metadata(writer, shape: Shape) -> None:
    for add, value in ((writer.add_block_count, shape.layers), (writer.add_context_length, shape.context),
                       (writer.add_embedding_length, shape.hidden), (writer.add_feed_forward_length, shape.ffn),
                       (writer.add_head_count, shape.heads), (writer.add_head_count_kv, shape.kv_heads),
                       (writer.add_key_length, shape.head_dim), (writer.add_value_length, shape.head_dim),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_rope_freq_base, shape.rope_base)):
        add(value)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    writer.add_file_type(LLAMA_FTYPES["Q8_0"])
    byte_vocabulary(writer, shape.vocab)


def byte_vocabulary(writer, vocab: int) -> None:
    """A SentencePiece vocabulary of the 256 byte tokens padded to `vocab`: any text encodes."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"▁filler{i}" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))
    writer.add_token_scores([0.0] * vocab)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_space_prefix(False)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def quantize_with_llama_cpp(src: Path, dst: Path, weight_type: str, threads: int | None = None) -> Path:
    """Requantize `src` (Q8_0) to `weight_type` with llama.cpp's own quantizer, as its users do."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise EdgeLLMError(f"{weight_type} files are made by llama.cpp's quantizer: "
                           "pip install 'edgellm[bench]' (llama-cpp-python)") from exc
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[weight_type]
    params.nthread = threads or os.cpu_count() or 1
    params.allow_requantize = True
    with atomic_path(dst) as tmp, _native_stderr_to(tmp.with_suffix(".log")) as log:
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
            raise EdgeLLMError(f"llama.cpp could not quantize {src.name} to {weight_type}: "
                               f"{log.read_text(errors='replace').strip().splitlines()[-1:]}")
    return dst


@contextmanager
def _native_stderr_to(path: Path) -> Iterator[Path]:
    """Native code's stderr into `path` for the block (llama.cpp's quantizer logs every tensor), removed after."""
    saved = os.dup(2)
    try:
        with open(path, "wb") as log:
            os.dup2(log.fileno(), 2)
            try:
                yield path
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)
        path.unlink(missing_ok=True)
