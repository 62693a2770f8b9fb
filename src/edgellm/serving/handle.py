"""A request as an app submits it, and the handle it gets back: the request's events
(TokenEvents, then one Completion) as they come, its state, and cancel()."""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from edgellm.generation import Completion
from edgellm.serving.scheduler import Plan, RequestState

DONE = object()  # end of a handle's event stream


@dataclass
class Request:
    prompt: Any  # str, token ids, or chat messages
    sampling: dict[str, Any] = field(default_factory=dict)
    chat: bool = False
    timeout_s: float = 15.0
    tools: list[dict] | None = None  # OpenAI tool definitions the chat prompt shows
    warmup: bool = False  # the server's own warm-up after start, not a client's (left out of the metrics)


class Handle:
    """A submitted request: iterate its events (TokenEvent..., Completion); cancel() any time."""

    def __init__(self, request: Request):
        self.request = request
        self.state = RequestState.WAITING
        self.degraded: list[str] = []  # e.g. "context_truncated", "thermal_throttle", "kv_int4_fallback"
        self.plan: Plan | None = None
        self.kv = None  # the KVManager it ran on (sessions pin its blocks there)
        self.prompt_ids: list[int] = []
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self._events: queue.Queue = queue.Queue()
        self._waker: Callable[[], None] | None = None  # set while an asyncio consumer awaits the next event
        self.on_done: Callable[[Handle, Completion], None] | None = None  # e.g. a Session recording the reply

    def cancel(self) -> None:
        self.cancelled.set()

    def next_event(self, timeout_s: float | None = None) -> Any:
        """The next TokenEvent or Completion; DONE at the end; None if nothing came within
        timeout_s. An error that ended the request is raised here."""
        try:
            return self._taken(self._events.get(timeout=timeout_s))
        except queue.Empty:
            return None

    async def next_event_async(self, timeout_s: float | None = None) -> Any:
        """next_event for asyncio code, awaited on the event loop itself: the engine thread's put()
        wakes it. (A worker thread blocking in next_event per event cost the HTTP server a thread
        hop per token: two wake-ups on a 2-core device busy with the decode step.)"""
        loop = asyncio.get_running_loop()
        while True:
            try:
                return self._taken(self._events.get_nowait())
            except queue.Empty:
                pass
            arrived = loop.create_future()
            self._waker = lambda: loop.call_soon_threadsafe(_resolve, arrived)
            try:
                if self._events.empty():  # else put() ran before the waker was set: take it now
                    await asyncio.wait_for(arrived, timeout_s)
            except asyncio.TimeoutError:
                return None
            finally:
                self._waker = None

    def _taken(self, event: Any) -> Any:
        if isinstance(event, BaseException):
            self._events.put(DONE)
            raise event
        return event

    def put(self, event: Any) -> None:
        self._events.put(event)
        waker = self._waker
        if waker is not None:
            try:
                waker()
            except RuntimeError:  # its event loop has closed: nobody is waiting any more
                pass

    def __iter__(self) -> Iterator:
        while (event := self.next_event()) is not DONE:
            yield event

    async def __aiter__(self):
        """The same events for asyncio code."""
        try:
            while (event := await self.next_event_async()) is not DONE:
                yield event
        finally:
            self.cancel()

    @property
    def queue_wait_s(self) -> float:
        return (self.started or time.perf_counter()) - self.submitted


def _resolve(arrived: asyncio.Future) -> None:
    if not arrived.done():  # a timeout may have cancelled it meanwhile
        arrived.set_result(None)
