"""What generation yields: one TokenEvent per generated token, then one Completion."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from edgellm.generation.logprobs import TokenLogprob

FinishReason = Literal["stop", "length", "timeout", "cancelled", "tool_calls"]


@dataclass(frozen=True)
class Timings:
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float  # request start -> first generated token
    prefill_s: float
    decode_s: float  # first token -> last token
    peak_rss_bytes: int
    kv_bytes: int = 0  # KV cache held at the end of generation (this sequence)
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    speculative: str = ""  # the drafter ("lookup", "draft", "self"); "" without speculation
    drafted_tokens: int = 0  # speculative guesses checked by the model
    accepted_tokens: int = 0  # guesses it kept
    target_passes: int = 0  # decode passes of the model (a check of several guesses is one)
    mask_s: float = 0.0  # seconds spent computing grammar masks (constrained output)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Generated tokens per decode pass (1.0 without speculation)."""
        steps = self.completion_tokens - 1
        return steps / self.target_passes if self.target_passes and steps > 0 else 1.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.completion_tokens - 1  # the first token comes from prefill
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        """The measured fields and the rates derived from them (for JSON output)."""
        rates = {"prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s}
        if self.speculative:
            rates |= {"acceptance_rate": self.acceptance_rate, "tokens_per_pass": self.tokens_per_pass}
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, **rates}


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # the text this token releases; "" while bytes or a possible stop are held back
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


@dataclass(frozen=True)
class Completion:
    finish_reason: FinishReason
    text: str  # the whole completion
    token_ids: tuple[int, ...]
    tail: str  # text released at the end that no TokenEvent carried (flushed hold-back)
    timings: Timings
    stop: str | int | None = None  # the stop string or EOS token id that ended generation
    # Under a constraint: whether the text is a whole valid output (False after max_tokens, a
    # timeout or a stop string cut it short); None without one.
    constraint_met: bool | None = None
    parsed: Any = None  # the value a valid constrained output stands for (Model.generate(schema=...))
    tool_calls: list[dict] | None = None  # OpenAI tool calls the answer made (Model.chat(tools=...))
    logprobs: tuple[TokenLogprob, ...] | None = None  # each generated token's, when asked for
    closed_early: bool = False  # a constrained JSON output the budget would have cut was closed validly
    # the prompt's tokens scored (echo): None for the first, which nothing predicts
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


GenerationEvent = TokenEvent | Completion
