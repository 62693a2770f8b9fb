"""What the routes of the other APIs (Anthropic's Messages, OpenAI's Responses) use of the server:
queue a chat request, read a handle's events, end its work. They translate their bodies into a
ChatRequest and its answer out of the engine's events; the queue, the models and the errors are the
chat route's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from edgellm.entrypoints.http.choices import Choice
from edgellm.entrypoints.http.schemas import ChatRequest
from edgellm.entrypoints.http.structured import StreamedDeltas, Structure
from edgellm.generation import Completion, TokenEvent
from edgellm.serving.handle import DONE


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


async def whole_answer(gateway: Gateway, sub: Submitted, client) -> Completion:
    """The first choice's Completion, waited for (a client that hangs up cancels it)."""
    try:
        while not isinstance(event := await gateway.next_event(sub.choices[0].handle, client), Completion):
            pass
        return event
    finally:
        cancel(sub.choices)


async def streamed_deltas(gateway: Gateway, sub: Submitted, first) -> AsyncIterator[tuple[dict | None, Any]]:
    """The first choice's answer as chat deltas (content, tool call starts, their arguments), each as
    (delta, None), then (None, (its Completion, the finish_reason to report)). The server's APIError
    of a failure goes up; the handle is cancelled when the consumer stops."""
    handle, deltas, event = sub.choices[0].handle, StreamedDeltas(sub.asked), first
    try:
        while True:
            event = event if event is not None else await gateway.next_event(handle)
            if event is DONE:
                return
            if isinstance(event, TokenEvent):
                for delta in deltas.push(event.text):
                    yield delta, None
                event = None
                continue
            held, finish_reason = deltas.finish(event.finish_reason)
            for delta in deltas.push(event.tail) + held:
                yield delta, None
            yield None, (event, finish_reason)
            return
    finally:
        cancel(sub.choices)


@dataclass
class Translated:
    """A request of another API, queued as a chat request: its own body, what was submitted, and
    the first event of a stream (`first`) or the whole answer (`done`)."""
    body: Any
    sub: Submitted
    first: Any = None
    done: Completion | None = None


async def translated(gateway: Gateway, request, parse: Callable[[dict], Any], to_chat: Callable[[Any], dict],
                     error: Callable[[int, str, str | None], JSONResponse]) -> Translated | JSONResponse:
    """Parse another API's body, queue it as the chat request `to_chat` makes, and wait for the first
    event (streams) or the answer; any failure is `error(status, message, code)` in that API's shape."""
    try:
        body = parse(await request.json())
        chat = ChatRequest.model_validate(to_chat(body))
    except (ValidationError, ValueError) as problem:
        return error(400, validation_message(problem), None)
    try:
        sub = await gateway.submit([[m.plain() for m in chat.messages]], chat, True)
    except gateway.api_error as failure:  # a full queue's Retry-After goes along
        response = error(failure.status, failure.message, failure.code)
        response.headers.update(failure.headers)
        return response
    client = gateway.client_watch(request)
    try:
        if body.stream:
            return Translated(body, sub, first=await gateway.next_event(sub.choices[0].handle, client))
        return Translated(body, sub, done=await whole_answer(gateway, sub, client))
    except gateway.api_error as failure:
        cancel(sub.choices)
        return error(failure.status, failure.message, failure.code)


def validation_message(problem: Exception) -> str:
    """A bad body's first problem, named where it is."""
    if isinstance(problem, ValidationError):
        first = problem.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return f"{where + ': ' if where else ''}{str(first.get('msg', 'bad value')).removeprefix('Value error, ')}"
    return str(problem)
