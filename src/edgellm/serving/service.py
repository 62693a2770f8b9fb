"""The service an app holds: one loaded model, one engine loop, a bounded queue, sessions.

Requests are tokenized (and long conversations trimmed) in the caller's thread, admitted only
while the queue has room (else `Busy` at once, never a pile-up), planned by the scheduler's
pure policy (model, KV precision, fallbacks, thermal rules), and run by the engine one step at
a time: up to `max_batch` requests decode together (latency mode is max_batch=1) while a
newcomer's prompt is prefilled in chunks between their steps. A request stops at its deadline
(counted from acceptance) with the text so far, and frees its KV at the end of the engine step
in which its caller cancels."""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from edgellm.serving.engine import Engine
from edgellm.errors import (Busy, ContextOverflow, InvalidRequest, KVStateMismatch, OutOfMemoryBudget, ServiceClosed,
                            type_and_stack)
from edgellm.generation import Completion, Timings
from edgellm.serving.handle import DONE, Handle, Request
from edgellm.memory import peak_rss_bytes
from edgellm.serving.scheduler import (FALLBACKS, Ask, DeviceState, ModelRoom, Policy, RequestState, RunningRequest,
                                       Shortfall, StepBudget, next_step, plan_request, turns_to_drop)
from edgellm.serving.session import Session

__all__ = ["DONE", "Handle", "Request", "Service", "Session"]  # the ones apps use, wherever they live
log = logging.getLogger("edgellm.serving.service")


class Service:
    def __init__(self, model, *, queue_limit: int = 3, default_timeout_s: float = 15.0,
                 on_finish: Callable[[Handle, Completion], None] | None = None, thermal=None,
                 hot_kv_precision: str = "int8", max_batch: int = 1, start: bool = True,
                 fallbacks: tuple[str, ...] = FALLBACKS, fallback_model=None, step_budget: StepBudget = StepBudget()):
        """max_batch 1 is latency mode (one request at a time); more is continuous batching:
        new requests join between steps, finished ones leave."""
        if max_batch < 1:
            raise InvalidRequest(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.queue_limit, self.default_timeout_s = model, queue_limit, default_timeout_s
        self.max_batch, self.step_budget = max_batch, step_budget
        self.policy = Policy(tuple(fallbacks), hot_kv_precision if thermal is not None else None)
        self.on_finish, self.thermal, self.fallback_model = on_finish, thermal, fallback_model
        self.engine = Engine()
        self._running: list[RunningRequest] = []
        self._waiting: queue.Queue = queue.Queue()
        self._calls: queue.Queue = queue.Queue()  # work for the engine's thread (call)
        self._deferred: Handle | None = None  # planned but did not fit yet: first in line
        self._lock = threading.Lock()
        self._depth = 0  # accepted, not yet running
        self._open = 0  # accepted, not yet ended: the service is idle at 0
        self._stopping = False
        self._cool_step_s: float | None = None  # decode step time measured while cool
        self._worker: threading.Thread | None = None
        if start:
            self._worker = threading.Thread(target=self.run_forever, name="edgellm-engine", daemon=True)
            self._worker.start()

    @property
    def queue_depth(self) -> int:
        return self._depth

    @property
    def busy(self) -> bool:
        return bool(self._running)

    @property
    def idle(self) -> bool:
        """No request accepted and not yet ended (waiting, being admitted or running)."""
        return self._open == 0

    # -- accepting requests (the caller's thread) ------------------------------------------

    @property
    def kv_bytes(self) -> tuple[int, int]:
        """The model's KV pool: bytes in use, and of those the prefix cache's (blocks no running
        sequence holds)."""
        used = self.model.kv.pool.used_bytes
        return used, used - self.model.kv.live_bytes

    def submit(self, request: Request, on_done: Callable[[Handle, Completion], None] | None = None) -> Handle:
        """Tokenize and queue a request, or raise at once: Busy when the queue is full,
        InvalidRequest / ContextOverflow for a prompt that can never run, ServiceClosed after
        close(). `on_done` gets the Completion in the engine thread before the caller does."""
        handle = Handle(request)
        handle.on_done = on_done
        self._tokenize(handle)
        with self._lock:
            if self._stopping:
                raise ServiceClosed("the service is closed")
            # An idle engine starts max_batch requests at once; beyond them queue_limit may wait.
            capacity = self.queue_limit + (0 if self._running else self.max_batch)
            if self._depth >= capacity:
                raise Busy(self._depth, self.queue_limit)
            self._depth += 1
            self._open += 1
            self._waiting.put(handle)
        return handle

    def _tokenize(self, handle: Handle) -> None:
        """The prompt's ids for the main model; a conversation longer than the context loses
        its oldest turns (when "shorter_context" is allowed). Linear in the conversation."""
        request, model = handle.request, self.model
        if not request.chat:
            handle.prompt_ids = model.prompt_ids(request.prompt)
        else:
            messages = request.prompt
            ids = _chat_ids(model, messages, request)
            if len(ids) >= model.context_length:
                messages, ids = self._trim_conversation(messages, len(ids), request)
                handle.request = replace(request, prompt=messages)
                handle.degraded.append("context_truncated")
            handle.prompt_ids = ids
        if not handle.prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if len(handle.prompt_ids) >= model.context_length:
            raise ContextOverflow(len(handle.prompt_ids), model.context_length)

    def _trim_conversation(self, messages: list[dict], total: int, request: Request) -> tuple[list[dict], list[int]]:
        model = self.model
        turns = _droppable_turns(messages)
        counts = [model.turn_tokens([messages[i] for i in turn]) for turn in turns]
        allowed = "shorter_context" in self.policy.fallbacks
        drop = turns_to_drop(total, counts, model.context_length, allowed)
        while drop <= len(turns):  # the counts are estimates: check, and drop one more if needed
            gone = {i for turn in turns[:drop] for i in turn}
            kept = [m for i, m in enumerate(messages) if i not in gone]
            ids = _chat_ids(model, kept, request)
            if len(ids) < model.context_length:
                return kept, ids
            drop += 1
        raise ContextOverflow(total, model.context_length)

    def call(self, work: Callable[[], Any]) -> Any:
        """Run `work` in the engine's thread between its steps and return what it returns (or raise
        what it raised): the native kernels serve one caller at a time, and this service's engine
        is theirs (embeddings run this way beside the generations)."""
        item = _Call(work)
        with self._lock:
            if self._stopping:
                raise ServiceClosed("the service is closed")
            self._calls.put(item)
            self._waiting.put(_WAKE)  # an idle engine waits on this queue
        item.done.wait()
        if item.error is not None:
            raise item.error
        return item.result

    def init(self, **session_options: Any) -> Session:
        """A new session (conversation) on this service's model."""
        return Session(self, **session_options)

    def restore(self, path: str | Path, **session_options: Any) -> Session:
        """A session continuing the conversation Session.save wrote to `path`: its KV goes into the
        prefix cache (KVStateMismatch for another model's or precision's file), so the next turn
        does not compute it again."""
        self.call(lambda: self.model.load_prefix(path))
        session = Session(self, **session_options)
        session.messages = _saved_messages(path)
        return session

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            self._waiting.put(None)
        if self._worker is not None:
            self._worker.join(timeout=30)

    # -- the engine loop ---------------------------------------------------------------------

    def run_forever(self) -> None:
        """The engine loop, in the calling thread (start=False). Measured: torch decodes ~2x
        slower in a thread when another thread has run parallel regions before (two OpenMP
        thread teams on 2 cores), so `edgellm serve` runs the engine in the thread that loaded
        the model and the HTTP server in another."""
        try:
            while not self._stopping:
                try:
                    self.step()
                except Exception as error:  # a bug: fail the running requests, keep serving
                    log.error("engine step failed: %s", type_and_stack(error))
                    for request in self._running:
                        self._abort(request, error)
                    self._running = []
        finally:
            self._shut_down()

    def step(self) -> None:
        """One cycle of the loop: admit waiting requests (each with its plan), schedule
        (scheduler.next_step), run (Engine.step), deliver each request's events, end what is over."""
        self._run_calls()
        self._admit(block=not self._running)
        self._run_calls()
        if not self._running:
            return
        step = next_step(self._running, self.step_budget)
        started = time.perf_counter()
        results = self.engine.step(step)
        if step.decode and not step.prefill:
            self._pace(step.decode, time.perf_counter() - started)
        for request, events in results.items():
            self._deliver(request, events)
        for request in self._running:
            self._expire(request)
        self._running = [r for r in self._running if not r.state.ended]

    def _run_calls(self) -> None:
        while not self._calls.empty():
            self._calls.get_nowait().run()

    def _shut_down(self) -> None:
        """Running requests end as cancelled (their KV freed), waiting ones get ServiceClosed."""
        for request in self._running:
            self._finish(request, request.generation.finish("cancelled"), RequestState.CANCELLED)
        self._running = []
        waiting = [self._deferred] if self._deferred is not None else []
        self._deferred = None
        while True:
            try:
                waiting.append(self._waiting.get_nowait())
            except queue.Empty:
                break
        while not self._calls.empty():
            self._calls.get_nowait().fail(ServiceClosed("the service was closed before this work ran"))
        for handle in waiting:
            if handle is not None and handle is not _WAKE:
                self._fail(handle, ServiceClosed("the service was closed before this request ran"))

    def _admit(self, block: bool) -> None:
        """Move waiting requests into the running set while there is room; each gets its plan.
        One whose KV does not fit beside the running ones waits for them (first in line)."""
        while len(self._running) < self.max_batch:
            handle = self._next_waiting(block)
            if handle is None:
                return
            block = False
            handle.started = handle.started or time.perf_counter()
            if handle.cancelled.is_set():
                handle.state = RequestState.CANCELLED
                self._ended()
                handle.put(DONE)
                continue
            if time.perf_counter() > self._deadline(handle):  # its time ran out in the queue: no work
                self._time_out_unstarted(handle)
                continue
            try:
                started = self._start(handle)
            except Exception as error:  # reported to its caller; the engine goes on
                self._fail(handle, error)
                continue
            if isinstance(started, Shortfall):
                if not self._running:
                    self._fail(handle, started.error())  # it does not fit even alone
                    continue
                self._deferred = handle  # it waits, first in line, for running requests to end
                return
            self._running.append(started)

    def _next_waiting(self, block: bool) -> Handle | None:
        if self._deferred is not None:
            handle, self._deferred = self._deferred, None
            return handle
        try:
            handle = self._waiting.get(block=block, timeout=None if block else 0)
        except queue.Empty:
            return None
        if handle is None:
            self._stopping = True
            return None
        if handle is _WAKE:
            return None
        with self._lock:
            self._depth -= 1
        return handle

    def _deadline(self, handle: Handle) -> float:
        return handle.submitted + (handle.request.timeout_s or self.default_timeout_s)

    def _time_out_unstarted(self, handle: Handle) -> None:
        handle.state = RequestState.TIMED_OUT
        timings = Timings(len(handle.prompt_ids), 0, 0.0, 0.0, 0.0, peak_rss_bytes())
        self._complete(handle, Completion("timeout", "", (), "", timings))

    def _start(self, handle: Handle) -> RunningRequest | Shortfall:
        request = handle.request
        sampling = dict(request.sampling)
        if sampling.get("adapter") is not None:  # a name resolves now; the object stays with the request
            sampling["adapter"] = self.model.adapters.get(sampling["adapter"])
        fallback = self._room(self.fallback_model, self._fallback_tokens(request)) if self.fallback_model else None
        room = self._room(self.model, prompt=handle.prompt_ids, adapter=sampling.get("adapter"))
        plan = plan_request(Ask(len(handle.prompt_ids), _max_tokens(sampling)), room, fallback, self._device(), self.policy)
        if isinstance(plan, Shortfall):
            return plan
        try:
            generation = self._generation(handle, plan, sampling)
        except OutOfMemoryBudget as error:  # the KV's own last check (e.g. a cached prefix's blocks): the same answer
            return Shortfall(error.needed_bytes, error.available_bytes)
        generation.kv.reserve(generation.seq, len(generation.prompt_ids) + generation.budget)
        running = RunningRequest(handle, generation, self._deadline(handle), Engine.batch_key(generation))
        running.state = RequestState.PREFILLING
        return running

    def _generation(self, handle: Handle, plan, sampling: dict):
        """The request's Generation on the model and KV precision its plan chose."""
        request = handle.request
        handle.plan = plan
        handle.degraded += [d for d in plan.degraded if d not in handle.degraded]
        if plan.fallback_model:
            sampling.pop("speculative", None)  # the fallback decodes as it was loaded to
            if sampling.pop("adapter", None) is not None:  # an adapter fits its own base only
                handle.degraded.append("adapter_dropped")
            generation = self.fallback_model.generation(request.prompt, chat=request.chat, kv=plan.kv_precision,
                                                        tools=request.tools, **sampling)
        else:
            generation = self.model.generation(handle.prompt_ids, kv=plan.kv_precision, **sampling)
            handle.kv = generation.kv
        return generation

    def _fallback_tokens(self, request: Request) -> int:
        """The prompt's length in the fallback model's tokens (its tokenizer may differ)."""
        model = self.fallback_model
        return len(_chat_ids(model, request.prompt, request) if request.chat else model.prompt_ids(request.prompt))

    def _room(self, model, prompt_tokens: int | None = None, prompt: Sequence[int] = (), adapter=None) -> ModelRoom:
        """What admission sees of a model's KV: its byte budget minus what running requests
        hold or may still grow into (their reservations); a request needs no room for the cached
        prefix blocks of `prompt` that running requests hold (it shares them: those computed
        under its adapter)."""
        kv = model.kv
        free = kv.free_bytes()

        def needed(precision: str, tokens: int) -> int:
            twin = model.kv_for(precision).for_adapter(adapter)
            return twin.bytes_needed(tokens) - twin.shared_bytes(prompt)

        return ModelRoom(model.context_length, kv.precision, needed, free,
                         sliding=kv.config.max_tokens is not None, prompt_tokens=prompt_tokens)

    def _device(self) -> DeviceState:
        return DeviceState(hot=self.thermal is not None and self.thermal.state().hot)

    def _pace(self, decoding: list[RunningRequest], elapsed: float) -> None:
        """Thermal policy: while hot, stretch each decode step so the rate is the cool rate
        × (1 − (T − 60)/100)."""
        state = self.thermal.state() if self.thermal is not None else None
        if state is None or not state.hot:
            self._cool_step_s = elapsed if self._cool_step_s is None else 0.8 * self._cool_step_s + 0.2 * elapsed
            return
        if self._cool_step_s:
            time.sleep(max(0.0, self._cool_step_s / state.rate_scale - elapsed))
            for r in decoding:
                if "thermal_throttle" not in r.handle.degraded:
                    r.handle.degraded.append("thermal_throttle")

    def _deliver(self, request: RunningRequest, events: list) -> None:
        for event in events:
            if isinstance(event, BaseException):
                self._abort(request, event)
                return
            if isinstance(event, Completion):
                self._finish(request, event, RequestState.FINISHED)
                return
            request.handle.put(event)

    def _expire(self, request: RunningRequest) -> None:
        """End a request its caller cancelled or whose deadline passed; its KV goes back now."""
        if request.state.ended:
            return
        if request.handle.cancelled.is_set():
            self._finish(request, request.generation.finish("cancelled"), RequestState.CANCELLED)
        elif request.expired(time.perf_counter()):
            self._finish(request, request.generation.finish("timeout"), RequestState.TIMED_OUT)

    def _finish(self, request: RunningRequest, done: Completion, state: RequestState) -> None:
        self._complete(self._end(request, state), done)

    def _ended(self) -> None:
        with self._lock:
            self._open -= 1

    def _complete(self, handle: Handle, done: Completion) -> None:
        self._ended()
        for callback in (handle.on_done and (lambda: handle.on_done(handle, done)),
                         self.on_finish and (lambda: self.on_finish(handle, done))):
            if callback:
                _quietly(callback)
        handle.put(done)
        handle.put(DONE)

    @staticmethod
    def _end(request: RunningRequest, state: RequestState) -> Handle:
        request.state = state
        return request.handle

    def _abort(self, request: RunningRequest, error: BaseException) -> None:
        """End a running request with an error: its KV goes back, its caller gets the error."""
        request.generation.close()
        self._fail(self._end(request, RequestState.FINISHED), error)

    def _fail(self, handle: Handle, error: BaseException) -> None:
        self._ended()
        handle.state = RequestState.FINISHED
        handle.put(error)
        handle.put(DONE)


_WAKE = object()  # wakes an idle engine for a call


class _Call:
    """Work for the engine's thread (Service.call), and its outcome."""

    def __init__(self, work: Callable[[], Any]):
        self.work, self.done = work, threading.Event()
        self.result, self.error = None, None

    def run(self) -> None:
        try:
            self.result = self.work()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            self.error = error
        finally:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


def _saved_messages(path: str | Path) -> list[dict]:
    from edgellm.kv.persist import saved_note

    try:
        messages = json.loads(saved_note(path) or "")
    except ValueError:
        messages = None
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise KVStateMismatch(f"{path}: holds a prefix, not a saved conversation (Session.save)")
    return messages


def _quietly(callback: Callable[[], None]) -> None:
    """An app's callback that fails is logged; it never stops the engine or the reply."""
    try:
        callback()
    except Exception as error:
        log.error("a completion callback failed: %s", type_and_stack(error))


def _max_tokens(sampling: dict[str, Any]) -> int:
    from edgellm.generation import SamplingParams

    return sampling.get("max_tokens", SamplingParams.max_tokens)


def _droppable_turns(messages: list[dict]) -> list[list[int]]:
    """Indices of the turns that may go, oldest first: each user message with the replies
    after it (dropping whole turns keeps roles alternating, which some templates require).
    System messages and the last turn stay."""
    turns: list[list[int]] = []
    for i, message in enumerate(messages):
        if message["role"] == "system":
            continue
        if message["role"] == "user" or not turns:
            turns.append([i])
        else:
            turns[-1].append(i)
    return turns[:-1]


def _chat_ids(model, messages: list[dict], request: Request) -> list[int]:
    """A conversation's prompt ids with the request's tools and its constraint's note."""
    return model.chat_ids(messages, request.tools, request.sampling.get("constraint"))
