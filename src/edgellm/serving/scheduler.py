"""Policy: what each request gets (model, KV precision, how much of its conversation) and what
the next engine step runs. Pure functions of the request and the device state, unit-tested
without a model; serving/engine.py carries the decisions out and serving/service.py holds the queue."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Hashable, Protocol, Sequence

from edgellm.errors import ContextOverflow, InvalidRequest, OutOfMemoryBudget
from edgellm.kernels.limits import MAX_SEQS

FALLBACKS = ("shorter_context", "int4_kv", "smaller_model")


class RequestState(str, Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def ended(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.CANCELLED, RequestState.TIMED_OUT)


@dataclass(frozen=True)
class Policy:
    fallbacks: tuple[str, ...] = FALLBACKS  # tried in this order when a request does not fit
    hot_precision: str | None = "int8"  # KV precision while the device is hot (None: unchanged)

    def __post_init__(self) -> None:
        unknown = set(self.fallbacks) - set(FALLBACKS)
        if unknown:
            raise InvalidRequest(f"unknown fallbacks: {', '.join(sorted(unknown))}")


@dataclass(frozen=True)
class ModelRoom:
    """What admission knows of one model now: its context, its default KV precision, the
    bytes a sequence of n tokens holds per precision, and the KV bytes free for a new one."""

    context_length: int
    precision: str
    bytes_needed: Callable[[str, int], int]  # (precision, tokens) -> bytes
    free_bytes: int | None  # None: no budget
    sliding: bool = False  # a sink + window cache: generation may run past the context
    prompt_tokens: int | None = None  # the prompt in this model's tokens, where its tokenizer differs


@dataclass(frozen=True)
class Ask:
    """A request as admission sees it."""

    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Plan:
    fallback_model: bool  # run on the smaller fallback model
    kv_precision: str
    degraded: tuple[str, ...] = ()


@dataclass(frozen=True)
class Shortfall:
    """Admission's answer when a request's KV does not fit the free bytes by any allowed means:
    a value, not an exception (the service waits for running requests to end, or refuses a
    request that would not fit even alone: `error()`)."""

    needed_bytes: int
    free_bytes: int

    def error(self) -> OutOfMemoryBudget:
        return OutOfMemoryBudget(self.needed_bytes, self.free_bytes)


@dataclass(frozen=True)
class DeviceState:
    hot: bool = False


def turns_to_drop(prompt_tokens: int, turn_tokens: Sequence[int], context: int, allowed: bool) -> int:
    """How many of the oldest droppable turns (their token counts, oldest first) must go for
    the prompt to fit the context; raises ContextOverflow naming the whole prompt's size when
    no number of them is enough (or dropping is not allowed)."""
    left = prompt_tokens
    for dropped in range(len(turn_tokens) + 1):
        if left < context:
            if dropped and not allowed:
                break
            return dropped
        if dropped < len(turn_tokens):
            left -= turn_tokens[dropped]
    raise ContextOverflow(prompt_tokens, context)


def plan_request(ask: Ask, main: ModelRoom, fallback: ModelRoom | None, device: DeviceState,
                 policy: Policy = Policy()) -> Plan | Shortfall:
    """The model and KV precision a request runs with. While hot: the smaller model when one is
    configured, and the hot KV precision. When its KV does not fit the free bytes: INT4 KV, then
    the smaller model, as the policy allows; else the Shortfall (the first option's)."""
    degraded: list[str] = []
    use_fallback = device.hot and fallback is not None and "smaller_model" in policy.fallbacks
    if use_fallback:
        degraded.append("smaller_model")
    hot_precision = policy.hot_precision if device.hot else None
    if hot_precision:
        degraded.append("thermal_kv_fallback")
    shortfall = None
    while True:
        room = fallback if use_fallback else main
        precisions = [hot_precision or room.precision]
        if "int4_kv" in policy.fallbacks and not precisions[0].startswith("int4"):
            precisions.append("int4")
        for i, precision in enumerate(precisions):
            needed = room.bytes_needed(precision, _kv_tokens(ask, room))
            if room.free_bytes is None or needed <= room.free_bytes:
                return Plan(use_fallback, precision, tuple(degraded + ["kv_int4_fallback"] * (i > 0)))
            shortfall = shortfall or (needed, room.free_bytes)
        if use_fallback or fallback is None or "smaller_model" not in policy.fallbacks:
            return Shortfall(*shortfall)
        use_fallback = True
        degraded += ["kv_int4_fallback"] * (len(precisions) > 1) + ["smaller_model"]


def _kv_tokens(ask: Ask, room: ModelRoom) -> int:
    """Tokens the request's KV holds at most (the generation budget stops at the context)."""
    prompt = ask.prompt_tokens if room.prompt_tokens is None else room.prompt_tokens
    generated = ask.max_tokens if room.sliding else min(ask.max_tokens, max(0, room.context_length - prompt))
    return prompt + generated


class Stepwise(Protocol):
    """What the scheduler reads of a request's generation (generation/generator.py Generation)."""

    prompt_left: int  # prompt tokens not yet in its KV


@dataclass(eq=False)
class RunningRequest:
    """A request the engine holds: its handle (events out), its step-wise generation, its
    deadline (from when it was accepted), its state, and `batch`, what the engine said of it when it
    started: requests of one batch key can share a native call (the same network and KV
    precision); None, it runs on its own."""

    handle: Any
    generation: Stepwise
    deadline: float
    batch: Hashable | None = None
    _state: RequestState = RequestState.PREFILLING

    @property
    def state(self) -> RequestState:
        return self._state

    @state.setter
    def state(self, state: RequestState) -> None:
        self._state = state
        if self.handle is not None:
            self.handle.state = state  # what the caller sees

    def expired(self, now: float) -> bool:
        return now > self.deadline


def joins(call: Sequence[RunningRequest], newcomer: RunningRequest) -> bool:
    """Whether `newcomer` can ride in one native call with the requests of `call`."""
    return newcomer.batch is not None and all(r.batch == newcomer.batch for r in call)


@dataclass
class Step:
    """One engine step: prompt chunks to prefill (request, tokens), then one decode step of
    every decoding request as a batch."""

    prefill: list[tuple[RunningRequest, int]] = field(default_factory=list)
    decode: list[RunningRequest] = field(default_factory=list)


@dataclass(frozen=True)
class StepBudget:
    prefill_chunk: int = 512  # prompt tokens per step when nothing else is decoding
    # While streams decode, a step carries their rows and this many tokens of a newcomer's prompt,
    # within the `step_rows` one native call takes: the streams' inter-token gap grows to that
    # call's time (bench --serving measures it), never to a whole prefill. A fixed share, not what
    # the streams leave of a fixed total: with 3 streams decoding that left the 4th one prompt
    # token a step (a 10-token prompt took 10 steps, and a burst of 4 requests 20 to ramp up).
    # Each newcomer gets this share while rows are free, oldest first: a burst of 4 requests with
    # 9-token prompts joined the batch in 6 steps, where one newcomer at a time took 10.
    interleaved_prompt: int = 3
    step_rows: int = MAX_SEQS  # rows one native call takes
    # Where the engine cannot join them (no native decoder, another model or KV precision), a
    # chunk runs through the prompt path on its own, whose cost hardly depends on its size.
    separate_chunk: int = 64


def next_step(running: Sequence[RunningRequest], budget: StepBudget = StepBudget()) -> Step:
    """Decode every decoding request; spend the step's prompt budget on the requests still
    prefilling, oldest first (first come, first served): the whole step when nothing decodes,
    else the rows the decode step's native call has free, to the newcomers whose batch key it
    shares (`joins`)."""
    step = Step(decode=[r for r in running if r.state is RequestState.DECODING])
    prefilling = [r for r in running if r.state is RequestState.PREFILLING]
    if not prefilling:
        return step
    oldest = prefilling[0]
    left = oldest.generation.prompt_left
    if not step.decode:
        step.prefill.append((oldest, min(budget.prefill_chunk, left)))
    elif len(step.decode) >= budget.step_rows or not joins(step.decode, oldest):  # the call is full, or not its
        step.prefill.append((oldest, min(budget.separate_chunk, left)))
    else:
        _share_free_rows(step, prefilling, budget)
    return step


def _share_free_rows(step: Step, prefilling: Sequence[RunningRequest], budget: StepBudget) -> None:
    """The call's rows beside the decode rows, `interleaved_prompt` tokens to each newcomer, oldest
    first, while rows are free; the oldest advances even when the decode rows fill the call."""
    free = budget.step_rows - len(step.decode)
    for new in prefilling:
        if step.prefill and free <= 0:
            break
        if step.prefill and not joins(step.decode + [r for r, _ in step.prefill], new):
            continue  # another network or KV precision: a later step
        tokens = max(1, min(budget.interleaved_prompt, free, new.generation.prompt_left))
        step.prefill.append((new, tokens))
        free -= tokens
