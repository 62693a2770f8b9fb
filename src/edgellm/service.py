"""The service an app holds: one loaded model, one engine thread, a bounded queue.

Requests are admitted only while the queue has room (else `Busy` at once, never a pile-up),
run one at a time (latency mode), stop at their deadline with the text so far
(finish_reason "timeout"), and free their KV the moment their caller cancels."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from edgellm.errors import Busy, ContextOverflow, InvalidRequest, OutOfMemoryBudget
from edgellm.generate import Completion

DONE = object()  # end of a handle's event stream


@dataclass
class Request:
    prompt: Any  # str, token ids, or chat messages
    sampling: dict[str, Any] = field(default_factory=dict)
    chat: bool = False
    timeout_s: float = 15.0


class Handle:
    """A submitted request: iterate its events (TokenEvent..., Completion); cancel() any time."""

    def __init__(self, request: Request):
        self.request = request
        self.degraded: list[str] = []  # e.g. "thermal_throttle", "thermal_kv_fallback"
        self.events: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.started: float | None = None

        self.on_done: Callable[[Completion], None] | None = None  # e.g. a Session recording the reply

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self) -> Iterator:
        while (event := self.events.get()) is not DONE:
            if isinstance(event, BaseException):
                raise event
            yield event

    async def __aiter__(self):
        """The same events for asyncio code (the blocking wait runs in a worker thread)."""
        import anyio

        try:
            while (event := await anyio.to_thread.run_sync(self.events.get)) is not DONE:
                if isinstance(event, BaseException):
                    raise event
                yield event
        finally:
            self.cancel()

    @property
    def queue_wait_s(self) -> float:
        return (self.started or time.perf_counter()) - self.submitted


class Service:
    def __init__(self, model, *, queue_limit: int = 3, default_timeout_s: float = 15.0,
                 on_finish: Callable[[Handle, Completion], None] | None = None, thermal=None,
                 hot_kv_precision: str = "int8", mode: str = "latency", max_batch: int = 4,
                 start: bool = True, fallbacks: tuple[str, ...] = ("shorter_context", "int4_kv", "smaller_model"),
                 fallback_model=None):
        """mode "latency": one request at a time. "throughput": up to max_batch requests decode
        together (continuous batching: new ones join between steps, finished ones leave)."""
        self.model, self.queue_limit, self.default_timeout_s = model, queue_limit, default_timeout_s
        self.mode, self.max_batch = mode, (max_batch if mode == "throughput" else 1)
        self._active: list = []  # throughput mode: (handle, generation, deadline)
        self.on_finish = on_finish
        self.thermal = thermal  # a ThermalGovernor, or None
        unknown = set(fallbacks) - {"shorter_context", "int4_kv", "smaller_model"}
        if unknown:
            raise InvalidRequest(f"unknown fallbacks: {', '.join(sorted(unknown))}")
        self.fallbacks, self.fallback_model = tuple(fallbacks), fallback_model
        self._fallback_cool_kv = fallback_model.kv if fallback_model is not None else None
        self._cool_kv = model.kv
        self._hot_kv = self._fallback_kv(model, hot_kv_precision) if thermal is not None else None
        self._cool_rate: float | None = None  # decode tokens/s measured while cool
        self._cool_step_s: float | None = None  # throughput mode: batch step time while cool
        self._waiting: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._depth = 0  # waiting, not yet running
        self._running: Handle | None = None
        self._stopping = False
        self._worker: threading.Thread | None = None
        if start:
            self._worker = threading.Thread(target=self.run_forever, name="edgellm-engine", daemon=True)
            self._worker.start()

    def run_forever(self) -> None:
        """The engine loop, in the calling thread (start=False). Measured: torch decodes ~2x
        slower in a thread when another thread has run parallel regions before (two OpenMP
        thread teams on 2 cores), so `edgellm serve` runs the engine in the thread that loaded
        the model and the HTTP server in another."""
        (self._loop_batched if self.max_batch > 1 else self._loop)()

    @property
    def queue_depth(self) -> int:
        return self._depth

    @property
    def busy(self) -> bool:
        return self._running is not None or bool(self._active)

    def submit(self, request: Request) -> Handle:
        """Queue a request or raise Busy right away."""
        with self._lock:
            if self._depth >= self.queue_limit and self._running is not None:
                raise Busy(self._depth, self.queue_limit)
            self._depth += 1
        handle = Handle(request)
        self._waiting.put(handle)
        return handle

    def init(self, **session_options: Any) -> Session:
        """A new session (conversation) on this service's model."""
        return Session(self, **session_options)

    def close(self) -> None:
        self._stopping = True
        self._waiting.put(None)
        if self._worker is not None:
            self._worker.join(timeout=30)

    def _loop(self) -> None:
        while True:
            handle = self._waiting.get()
            if handle is None or self._stopping:
                return
            with self._lock:
                self._depth -= 1
                self._running = handle
            handle.started = time.perf_counter()
            try:
                if not handle.cancelled.is_set():
                    self._run(handle)
            except BaseException as error:  # reported to the caller, never kills the engine
                handle.events.put(error)
            finally:
                with self._lock:
                    self._running = None
                handle.events.put(DONE)

    # -- throughput mode -----------------------------------------------------------------

    def _loop_batched(self) -> None:
        import torch

        from edgellm.generate.generator import decode_step

        while not self._stopping:
            self._admit(block=not self._active)
            live = [entry for entry in self._active if not entry[1].done]
            if not live:
                continue
            step_start = time.perf_counter()
            with torch.inference_mode():
                logits = decode_step(self.model.net, [g for _, g, _ in live])
            self._pace_step(live, time.perf_counter() - step_start)
            for i, entry in enumerate(live):
                self._deliver_batched(entry, entry[1].accept(logits[i]))
            self._active = [e for e in self._active if not e[1].done]

    def _pace_step(self, live: list, elapsed: float) -> None:
        """Throughput mode's thermal policy: while hot, stretch each batch step so the decode
        rate is the cool rate × (1 − (T − 60)/100)."""
        state = self.thermal.state() if self.thermal is not None else None
        if state is None or not state.hot:
            self._cool_step_s = elapsed if self._cool_step_s is None else 0.9 * self._cool_step_s + 0.1 * elapsed
            return
        if self._cool_step_s:
            time.sleep(max(0.0, self._cool_step_s / state.rate_scale - elapsed))
            for handle, _, _ in live:
                if "thermal_throttle" not in handle.degraded:
                    handle.degraded.append("thermal_throttle")

    def _admit(self, block: bool) -> None:
        """Move waiting requests into the running batch (prefill each) while there is room."""
        import torch

        while len(self._active) < self.max_batch:
            try:
                handle = self._waiting.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                return
            block = False
            if handle is None:
                self._stopping = True
                return
            with self._lock:
                self._depth -= 1
            handle.started = time.perf_counter()
            request = handle.request
            try:
                self._thermal_policy(handle)
                generation = self.model.generation(request.prompt, chat=request.chat, **request.sampling)
                with torch.inference_mode():
                    first = generation.accept(generation.prefill())
            except BaseException as error:
                handle.events.put(error)
                handle.events.put(DONE)
                continue
            entry = (handle, generation, handle.started + (request.timeout_s or self.default_timeout_s))
            self._active.append(entry)
            self._deliver_batched(entry, first)

    def _deliver(self, entry, events: list) -> None:
        """Pass one step's events on; end the request at its deadline or when cancelled."""
        handle, generation, deadline = entry
        for event in events:
            if isinstance(event, Completion):
                self._finish(handle, event)
                return
            handle.events.put(event)
        if handle.cancelled.is_set() or time.perf_counter() > deadline:
            reason = "cancelled" if handle.cancelled.is_set() else "timeout"
            self._finish(handle, generation.finish(reason))  # its KV goes back now

    def _deliver_batched(self, entry, events: list) -> None:
        self._deliver(entry, events)
        if entry[1].done:
            entry[0].events.put(DONE)  # latency mode's loop does this in its finally

    # -- fallbacks and thermal policy ------------------------------------------------------

    @staticmethod
    def _fallback_kv(model, precision: str):
        from dataclasses import replace

        from edgellm.kv import KVManager

        config = replace(model.kv.config, k_precision=precision, v_precision=precision)
        return KVManager(model.net.cache_specs(), config, model.context_length, salt=model.kv.salt)

    def _thermal_policy(self, handle: Handle):
        """Pick the KV for this request; returns the thermal state (None without a governor)."""
        if self.thermal is None:
            return None
        state = self.thermal.state()
        self.model.kv = self._hot_kv if state.hot else self._cool_kv
        if state.hot:
            handle.degraded.append("thermal_kv_fallback")
        return state

    def _pace(self, handle: Handle, last_token_at: float) -> float:
        """While hot, hold decoding to the cool rate × the thermal scale; returns the time now."""
        now = time.perf_counter()
        state = self.thermal.state() if self.thermal is not None else None
        if state is None or not state.hot:
            return now
        if self._cool_rate:
            wait = 1.0 / (self._cool_rate * state.rate_scale) - (now - last_token_at)
            if wait > 0:
                time.sleep(wait)
            if "thermal_throttle" not in handle.degraded:
                handle.degraded.append("thermal_throttle")
        return time.perf_counter()

    def _start(self, handle: Handle):
        """Create the request's Generation, walking the configured fallback chain when it
        does not fit: "shorter_context" drops the oldest chat turns on overflow, "int4_kv"
        retries with INT4 KV when the KV budget is short, "smaller_model" hands the request to
        the fallback model (also while the device is hot)."""
        request, model = handle.request, self.model
        if self._hot_model_switch():
            model = self._use_smaller(handle)
        while True:
            try:
                return model.generation(request.prompt, chat=request.chat, **request.sampling)
            except OutOfMemoryBudget:
                if "int4_kv" in self.fallbacks and model.kv.config.k_precision != "int4":
                    model.kv = self._fallback_kv(model, "int4")
                    handle.degraded.append("kv_int4_fallback")
                elif "smaller_model" in self.fallbacks and self.fallback_model is not None \
                        and model is not self.fallback_model:
                    model = self._use_smaller(handle)
                else:
                    raise
            except ContextOverflow:
                shorter = _drop_oldest_turn(request.prompt) if request.chat else None
                if "shorter_context" not in self.fallbacks or shorter is None:
                    raise
                request = replace(request, prompt=shorter)
                handle.degraded.append("context_truncated") if "context_truncated" not in handle.degraded else None

    def _hot_model_switch(self) -> bool:
        return (self.thermal is not None and self.fallback_model is not None and "smaller_model" in self.fallbacks
                and self.thermal.state().hot)

    def _use_smaller(self, handle: Handle):
        handle.degraded.append("smaller_model")
        return self.fallback_model

    def _run(self, handle: Handle) -> None:
        """Latency mode: one request, prefill then decode steps, until it ends or its deadline."""
        import torch

        from edgellm.generate.generator import decode_step

        self._thermal_policy(handle)
        try:
            generation = self._start(handle)
        finally:
            if self.thermal is None or not self.thermal.state().hot:
                self.model.kv = self._cool_kv  # a fallback lasts for one request
            if self.fallback_model is not None:
                self.fallback_model.kv = self._fallback_cool_kv
        entry = (handle, generation, handle.started + (handle.request.timeout_s or self.default_timeout_s))
        last = time.perf_counter()
        try:
            with torch.inference_mode():
                logits = generation.prefill()
                while True:
                    self._deliver(entry, generation.accept(logits))
                    if generation.done:
                        break
                    last = self._pace(handle, last)
                    logits = decode_step(generation.model, [generation])[0]
        finally:
            generation.close()  # frees the sequence's KV at once, however the request ended
        done = generation.completion
        if "thermal_throttle" not in handle.degraded and done.timings.decode_tokens_per_s > 0:
            self._cool_rate = done.timings.decode_tokens_per_s

    def _finish(self, handle: Handle, done: Completion) -> None:
        if handle.on_done is not None:
            handle.on_done(done)
        handle.events.put(done)
        if self.on_finish is not None:
            self.on_finish(handle, done)


def _drop_oldest_turn(messages: list[dict]) -> list[dict] | None:
    """The conversation without its oldest non-system message; None when only the last
    user message (and system prompt) is left."""
    for i, message in enumerate(messages[:-1]):
        if message["role"] != "system":
            return messages[:i] + messages[i + 1:]
    return None


class Session:
    """What an app holds: one conversation on the shared model. Its KV stays cached between
    turns (pinned in the model's prefix cache, when enabled) until release() frees it."""

    def __init__(self, service: Service, *, system: str | None = None, timeout_s: float | None = None,
                 **sampling: Any):
        self.service, self.sampling, self.timeout_s = service, sampling, timeout_s
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self._pinned: list[str] = []
        self.released = False

    def infer(self, content: str, **sampling: Any) -> Handle:
        """Send the next user message; iterate (or async-iterate) the returned handle."""
        if self.released:
            raise InvalidRequest("this session was released")
        messages = self.messages + [{"role": "user", "content": content}]
        request = Request(messages, {**self.sampling, **sampling}, chat=True,
                          timeout_s=self.timeout_s or self.service.default_timeout_s)
        handle = self.service.submit(request)
        handle.on_done = lambda done: self._record(messages, done)
        return handle

    def _record(self, messages: list[dict], done: Completion) -> None:
        self.messages = messages + [{"role": "assistant", "content": done.text}]
        prefix = self.service.model.kv.prefix
        if prefix is None:
            return
        from edgellm.kv import chain_hashes

        kv = self.service.model.kv
        ids = self.service.model.template.encode_chat(messages) + list(done.token_ids)
        hashes = chain_hashes(ids, kv.config.block_size, kv.salt)
        prefix.release(self._pinned)
        self._pinned = hashes[:len(prefix.lookup(hashes))]  # pinned until the next turn or release()

    @property
    def kv_bytes(self) -> int:
        """KV this session keeps between turns."""
        return len(self._pinned) * self.service.model.kv.pool.block_bytes

    def release(self) -> int:
        """Free this session's KV now; returns the bytes freed."""
        freed = 0
        prefix = self.service.model.kv.prefix
        if prefix is not None and self._pinned:
            prefix.release(self._pinned)
            freed = prefix.drop(self._pinned) * self.service.model.kv.pool.block_bytes
        self._pinned, self.released = [], True
        return freed
