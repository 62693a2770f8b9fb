"""What the routes of the other APIs (Anthropic's Messages, OpenAI's Responses) use of the server:
queue a chat request, read a handle's events, end its work. They translate their bodies into a
ChatRequest and its answer out of the engine's events; the queue, the models and the errors are the
chat route's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from edgellm.entrypoints.http.choices import Choice
from edgellm.entrypoints.http.structured import Structure


@dataclass
class Submitted:
    choices: list[Choice]
    answered: str  # the model id the answer names
    asked: Structure
    tokenizer: Any  # the model's: log-probabilities name its tokens


@dataclass(frozen=True)
class Gateway:
    submit: Callable[..., Awaitable[Submitted]]  # (prompts, ChatRequest, chat=True) -> Submitted
    next_event: Callable[..., Awaitable[Any]]  # (handle, client watch or None) -> the next event
    client_watch: Callable[[Any], Any]  # a request -> what notices its client hang up
    api_error: type  # the server's APIError (status, message, kind, code)


def cancel(choices: list[Choice]) -> None:
    for c in choices:
        c.handle.cancel()
