"""One sequence's grammar state: which tokens may come next (a mask over the logits) and what
has been generated so far. llguidance walks the grammar over the bytes each token stands for,
so it sees edgellm's own tokenizer (byte-level or SentencePiece) as a table of token bytes."""
from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from edgellm.generation.constrain.spec import Constraint, InvalidConstraint
from edgellm.tokenizer import Tokenizer

# A pattern of `period` tokens repeated `times` in a row is a loop, not an answer: a small model
# forced into a number or string may write "3.5055555..." until max_tokens. The token that
# would go round again is then refused (when the grammar allows anything else). Lengths that
# real values reach pass: Gemma spells "1000000000" digit by digit (nine zeros).
LOOPS = ((1, 12), (2, 8), (3, 6), (4, 6))  # (period, times)

# One thread computes the next masks of all sequences, overlapping the model's forward pass.
_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgellm-grammar")
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


class _TokenTable:
    """What llguidance asks of a tokenizer: each token's bytes (control tokens marked with a
    leading 0xFF, so no text can produce them), the end tokens, and text -> ids."""

    def __init__(self, tokenizer: Tokenizer):
        specials = tokenizer.special_ids
        self.tokens = [b"\xff" + tokenizer.id_to_token(i).encode() if i in specials else tokenizer.token_bytes(i)
                       for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(specials)
        self.eos_token_id = min(tokenizer.eos_ids) if tokenizer.eos_ids else None
        self.bos_token_id = tokenizer.bos_id
        self._encode = tokenizer.encode

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text, add_special_tokens=False)


def grammar_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer`, built once per tokenizer (0.4 s for SmolLM2's 49k
    tokens, 2 s for Gemma 3's 262k) and shared by every sequence."""
    with _tables_lock:
        table = _tables.get(tokenizer)
        if table is None:
            table = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tokenizer)),
                                           eos_token=sorted(tokenizer.eos_ids) or None)
            _tables[tokenizer] = table
        return table


class GrammarState:
    """Masks a position's logits to the tokens that can continue a valid output (the end
    tokens only where the output may end) and follows the tokens taken."""

    def __init__(self, constraint: Constraint, tokenizer: Tokenizer):
        self.constraint = constraint
        self.matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer), constraint.grammar, log_level=0)
        if self.matcher.is_error():
            raise InvalidConstraint(constraint.kind, self.matcher.get_error())
        self.vocab_size = tokenizer.vocab_size
        self.end_ids = sorted(tokenizer.eos_ids)
        self._encode = tokenizer.encode
        self._bits = allocate_token_bitmask(1, self.vocab_size)
        self.taken: list[int] = []  # tokens consumed
        self.mask_s = 0.0  # seconds spent masking (Timings.mask_s)
        self._next: Future | None = None  # the next mask, being computed
        self._filled = False  # _bits holds the mask for the current position

    @property
    def satisfied(self) -> bool:
        """The output so far is a whole valid one."""
        self._settle()
        return not self.matcher.is_error() and self.matcher.is_accepting()

    def allowed(self) -> np.ndarray:
        """A bool per token id: may it come next."""
        self._settle()
        if self.matcher.is_error():  # cannot happen with masked sampling; end rather than go on unchecked
            allowed = np.zeros(self.vocab_size, dtype=np.bool_)
            allowed[self.end_ids] = True
            return allowed
        if not self._filled:
            self._fill()
        self._filled = False
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size].view(np.bool_)
        looping = self._loop_continuation()
        if looping is not None and allowed[looping] and int(allowed.sum()) > 1:
            allowed[looping] = False
        return allowed

    def _loop_continuation(self) -> int | None:
        """The token that would repeat a loop the output is in (LOOPS), if it is in one."""
        taken = self.taken
        for period, times in LOOPS:
            n = period * times
            if len(taken) >= n and taken[-n:] == taken[-period:] * times:
                return taken[-period]
        return None

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits` (1-D) with every token that cannot come next at -inf (a copy)."""
        started = time.perf_counter()
        logits = np.asarray(logits, dtype=np.float32)
        allowed = self.allowed()
        if logits.shape[-1] != len(allowed):  # rows past the tokenizer (padding) are never allowed
            allowed = np.pad(allowed[:logits.shape[-1]], (0, max(0, logits.shape[-1] - len(allowed))))
        masked = np.where(allowed, logits, np.float32(-np.inf))
        self.mask_s += time.perf_counter() - started
        return masked

    def end_at(self, pieces: list[str]) -> int | None:
        """Where the output so far (its text in pieces) should end though the grammar goes on
        (before a tool call that repeats an earlier one: a small model's loop); None: it goes on."""
        cut = self.constraint.cut
        if cut is None:
            return None  # without joining the text or waiting for the next mask: every token asks
        self._settle()
        return None if self.matcher.is_error() else cut("".join(pieces))

    def consume(self, token: int) -> None:
        """Take `token`; the next mask is computed meanwhile in a worker thread (llguidance
        drops the GIL), while the model computes the next logits."""
        self._settle()
        self.matcher.consume_token(token)
        self.taken.append(token)
        self._next = _WORKER.submit(self._fill)

    def _fill(self) -> None:
        fill_next_token_bitmask(self.matcher, self._bits)
        self._filled = True

    def _settle(self) -> None:
        """Wait for the mask being computed: nothing else may touch the matcher meanwhile."""
        if self._next is not None:
            self._next.result()
            self._next = None

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar would take from here."""
        self._settle()
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def closing_tokens(self, text: str) -> list[int] | None:
        """`text`'s tokens if the grammar takes them from here and may end after them, else None."""
        self._settle()
        ids = self._encode(text, add_special_tokens=False)
        trial = self.matcher.deep_copy()
        if trial.validate_tokens(ids) != len(ids):
            return None
        trial.consume_tokens(ids)
        return ids if trial.is_accepting() else None

    def forced(self) -> list[int]:
        """Tokens the grammar forces next whatever the model says (a JSON key after `{"`)."""
        self._settle()
        return self.matcher.compute_ff_tokens()
