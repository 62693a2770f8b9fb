"""Sessions: what an app holds for one conversation on a shared service."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Protocol

from edgellm.errors import InvalidRequest
from edgellm.generation import Completion
from edgellm.serving.handle import Handle, Request


class Submitter(Protocol):
    """What a session needs of the service (serving/service.py) it runs on."""

    default_timeout_s: float
    model: Any  # the api Model it runs

    def submit(self, request: Request, on_done: Callable[[Handle, Completion], None] | None = None) -> Handle: ...

    def call(self, work: Callable[[], Any]) -> Any: ...


class Session:
    """What an app holds: one conversation on the shared model. The KV of its last turn stays
    pinned in the model's prefix cache between turns until release() frees it."""

    def __init__(self, service: Submitter, *, system: str | None = None, timeout_s: float | None = None,
                 **sampling: Any):
        self.service, self.sampling, self.timeout_s = service, sampling, timeout_s
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self._kv, self._pins = None, []
        self.released = False

    def infer(self, content: str, **sampling: Any) -> Handle:
        """Send the next user message; iterate (or async-iterate) the returned handle."""
        if self.released:
            raise InvalidRequest("this session was released")
        messages = self.messages + [{"role": "user", "content": content}]
        request = Request(messages, {**self.sampling, **sampling}, chat=True,
                          timeout_s=self.timeout_s or self.service.default_timeout_s)
        return self.service.submit(request, on_done=lambda handle, done: self._record(handle, messages, done))

    def _record(self, handle: Handle, messages: list[dict], done: Completion) -> None:
        self.messages = messages + [{"role": "assistant", "content": done.text}]
        self._unpin()
        if handle.kv is not None:  # pinned until the next turn or release()
            self._kv, self._pins = handle.kv, handle.kv.pin(handle.prompt_ids + list(done.token_ids))

    def _unpin(self, drop: bool = False) -> int:
        freed = self._kv.unpin(self._pins, drop=drop) if self._kv is not None else 0
        self._kv, self._pins = None, []
        return freed

    @property
    def kv_bytes(self) -> int:
        """KV this session keeps between turns."""
        return self._kv.pinned_bytes(self._pins) if self._kv is not None else 0

    def save(self, path: str | Path) -> int:
        """Save the conversation so far and its KV to `path` (written whole or not at all; the
        model's identity goes with it); Service.restore continues it, in this process or another,
        without computing its prompt again. Returns the tokens saved (whole KV blocks)."""
        if self.released:
            raise InvalidRequest("this session was released")
        messages = list(self.messages)
        if not messages:
            raise InvalidRequest("an empty conversation has nothing to save")
        model = self.service.model
        return self.service.call(lambda: model.save_prefix(messages, path, note=json.dumps(messages)))

    def release(self) -> int:
        """Free this session's KV now; returns the bytes freed."""
        freed = self._unpin(drop=True)
        self.released = True
        return freed
