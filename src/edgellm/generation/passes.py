"""A model's passes over a sequence's KV, below the generation loop: a prompt in pieces (prefill),
one decode step for several sequences, a few rows in one native call (speculative checks, draft
catch-up). generator.py, speculative.py and drafters.py build on these."""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from edgellm.extras import inference
from edgellm.generation.logprobs import TokenLogprob, rows_logprobs
from edgellm.generation.sampling import as_logits
from edgellm.kernels.limits import MAX_SEQS
from edgellm.kv import BatchKV, KVManager, SequenceKV

PREFILL_CHUNK = 512  # tokens per prefill pass: bounds attention scratch memory


class CausalLM(Protocol):
    config: object  # has n_layers, context_length

    # tokens (B, T) int64 -> logits (B, T or 1, V) fp32: numpy from the native layers, a tensor from PyTorch's
    def __call__(self, tokens: np.ndarray, caches: Sequence, last_only: bool = False): ...


def prefill(model: CausalLM, seq: SequenceKV, ids: Sequence[int], chunk: int = PREFILL_CHUNK) -> np.ndarray:
    """Run `ids` through the model into `seq` in pieces of at most `chunk` that end on KV block
    boundaries (or pieces of the native step, where the decoder takes them: models/native/decoder.py
    FusedDecoder.takes_prompt and piece_rows); returns the
    last position's logits. (A ring-window-sized piece that began inside a
    block — after a few tokens interleaved with other streams — would push that block's first
    tokens out of the ring before the block is remembered for prefix reuse: prefill_chunk.)"""
    logits, start, block = None, 0, seq.config.block_size
    decoder = getattr(model, "decoder", None)
    native = decoder is not None and decoder.takes_prompt(len(ids))
    rows = decoder.piece_rows(len(ids)) if native else chunk
    while start < len(ids):
        size = rows
        if size >= block:  # a piece shorter than a block cannot push a block's first tokens out of a ring
            size -= seq.offset % block
        piece = list(ids[start:start + size])
        seq.prepare(len(piece))
        if not (native and start + len(piece) < len(ids) and _layers_alone(model, seq, piece)):
            logits = as_logits(model(np.array([piece], dtype=np.int64), seq, last_only=True)[0, -1])
        seq.advance(piece)
        start += len(piece)
    return logits


SCORED_ROWS = 64  # prompt rows scored per pass: their logits (rows x vocabulary) are kept whole


def prefill_scored(model: CausalLM, seq: SequenceKV, ids: Sequence[int], top: int,
                   before: np.ndarray | None = None) -> tuple[np.ndarray, list[TokenLogprob]]:
    """`ids` into `seq` like prefill, every position's logits kept: returns the last position's
    logits and each of `ids` scored by the position before it (the first by `before`, the logits
    that came before this piece; left out when there are none)."""
    decoder = getattr(model, "decoder", None)
    rows = min(SCORED_ROWS, decoder.piece_rows(len(ids))) if decoder is not None else SCORED_ROWS
    scored, start = [], 0
    while start < len(ids):
        piece = list(ids[start:start + rows])
        seq.prepare(len(piece))
        logits = None if decoder is None else decoder.step_rows([(seq.layers, piece)], every_row=True,
                                                                 adapters=[getattr(seq, "adapter", None)])
        if logits is None:
            logits = as_logits(model(np.array([piece], dtype=np.int64), seq, last_only=False)[0])
        seq.advance(piece)
        predicting = logits[:-1] if before is None else np.concatenate([before[None], logits[:-1]])
        scored += rows_logprobs(predicting, piece[1:] if before is None else piece, top)
        before, start = logits[-1], start + len(piece)
    return before, scored


def hidden_states(model: CausalLM, seq: SequenceKV, ids: Sequence[int]) -> np.ndarray | None:
    """`ids` into `seq` through the native layers: every position's last hidden state (T, hidden),
    before the final norm; None where the model has no native decoder for them."""
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return None
    rows, out, start = decoder.piece_rows(len(ids)), [], 0
    while start < len(ids):
        piece = list(ids[start:start + rows])
        seq.prepare(len(piece))
        x = decoder.hidden_rows([(seq.layers, piece)], adapters=[getattr(seq, "adapter", None)])
        if x is None:
            return None
        out.append(x.copy())
        seq.advance(piece)
        start += len(piece)
    return np.concatenate(out)


def _layers_alone(model: CausalLM, seq: SequenceKV, piece: list[int]) -> bool:
    """A prompt's piece before its last through the native layers without the head, whose logits
    nobody reads (Gemma 3's 262k-row head: ~4 ms a call); False where the native call cannot take it."""
    done = model.decoder.step_rows([(seq.layers, piece)], adapters=[getattr(seq, "adapter", None)],
                                    wanted=[False])
    return done is not None


def prefill_chunk(kv: KVManager) -> int:
    # A ring layer must still hold a finished block when it is remembered for prefix reuse.
    windows = [s.window for s in kv.specs if s.window is not None]
    chunk = min([PREFILL_CHUNK, *windows])
    return max(kv.config.block_size, chunk // kv.config.block_size * kv.config.block_size)


def decode_step(model: CausalLM, generations: list) -> np.ndarray:
    """One decode step for several sequences at once (generations: each with its `seq` and
    `next_token`): their linears run as one batch (the native
    decoder's one call where it takes them, handed plain ints: no token tensor to build and take
    apart). Returns (len(generations), V) logits."""
    for g in generations:
        g.seq.prepare(1)
    decoder = getattr(model, "decoder", None)
    direct = decoder is not None and all(g.seq.layers for g in generations)
    logits = None if not direct else decoder.step_rows([(g.seq.layers, [g.next_token]) for g in generations],
                                                            adapters=[g.seq.adapter for g in generations])
    if logits is None:
        tokens = np.array([[g.next_token] for g in generations], dtype=np.int64)
        caches = generations[0].seq if len(generations) == 1 else BatchKV([g.seq for g in generations])
        logits = as_logits(model(tokens, caches, last_only=True)[:, -1])
    for g in generations:
        g.seq.advance([g.next_token])
    return logits


def verify(model, seq, tokens: list[int]) -> np.ndarray:
    """Run `tokens` (the next token and the guesses after it) through the target into `seq`,
    keeping what they overwrite for a trim; returns every position's logits (len(tokens), V)."""
    return run_rows(model, seq, tokens, every_row=True, undoable=True)


def run_rows(model, seq, tokens: list[int], every_row: bool = False, undoable: bool = False) -> np.ndarray:
    """A few tokens (at most MAX_SEQS) into `seq` as rows of one native call where the model
    has one; logits of every row (every_row) or of the last (1, V)."""
    seq.prepare(len(tokens))
    if undoable:
        seq.keep_overwritten(len(tokens))
    decoder = getattr(model, "decoder", None)
    logits = None if decoder is None else decoder.step_rows([(seq.layers, tokens)], every_row, [seq.adapter])
    if logits is None:
        logits = as_logits(model(np.array([tokens], dtype=np.int64), seq, last_only=not every_row)[0])
    seq.advance(tokens)
    return logits


def warm_rows(model, kv) -> None:
    """Run 2 ... MAX_SEQS rows through the model once on a throwaway sequence: PyTorch's
    first matmul of each new row count builds its kernels (tens of ms), which would otherwise be
    charged to the first checks and mislead the policy."""
    if getattr(model, "decoder", None) is not None:
        return  # the native layers have nothing to build
    seq, _ = kv.new_sequence([])
    try:
        with inference():
            for rows in range(2, MAX_SEQS + 1):
                run_rows(model, seq, [0] * rows, every_row=True)
                seq.trim(rows)
    finally:
        seq.release()
