"""A request as an app submits it, and the handle it gets back: the request's events
(TokenEvents, then one Completion) as they come, its state, and cancel()."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from edgellm.generate import Completion
from edgellm.scheduler import Plan, RequestState

DONE = object()  # end of a handle's event stream


@dataclass
class Request:
    prompt: Any  # str, token ids, or chat messages
    sampling: dict[str, Any] = field(default_factory=dict)
    chat: bool = False
    timeout_s: float = 15.0
    tools: list[dict] | None = None  # OpenAI tool definitions the chat prompt shows


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
        self.on_done: Callable[[Handle, Completion], None] | None = None  # e.g. a Session recording the reply

    def cancel(self) -> None:
        self.cancelled.set()

    def next_event(self, timeout_s: float | None = None) -> Any:
        """The next TokenEvent or Completion; DONE at the end; None if nothing came within
        timeout_s. An error that ended the request is raised here."""
        try:
            event = self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if isinstance(event, BaseException):
            self._events.put(DONE)
            raise event
        return event

    def put(self, event: Any) -> None:
        self._events.put(event)

    def __iter__(self) -> Iterator:
        while (event := self.next_event()) is not DONE:
            yield event

    async def __aiter__(self):
        """The same events for asyncio code (the blocking wait runs in a worker thread)."""
        import anyio

        try:
            while (event := await anyio.to_thread.run_sync(self.next_event)) is not DONE:
                yield event
        finally:
            self.cancel()

    @property
    def queue_wait_s(self) -> float:
        return (self.started or time.perf_counter()) - self.submitted
