"""The OpenAI-compatible routes. Errors leave in OpenAI's JSON shape with the right status;
logs carry request ids, sizes and timings, never prompt or completion text."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgellm.errors import (Busy, ContextOverflow, EdgeLLMError, InvalidRequest, ModelNotFound, OutOfMemoryBudget,
                            type_and_stack)
from edgellm.generation import Completion, TokenEvent
from edgellm.memory import peak_rss_bytes
from edgellm.registry import cache_dir
from edgellm.entrypoints.http.adapters import add_adapter_routes, model_entry, pick_adapter
from edgellm.entrypoints.http.admin import add_admin_routes
from edgellm.entrypoints.http.anthropic import add_anthropic_routes
from edgellm.entrypoints.http.responses_api import add_responses_routes
from edgellm.entrypoints.http.embeddings import add_embedding_routes
from edgellm.entrypoints.http.kv_files import add_kv_routes
from edgellm.entrypoints.http.tokens import add_token_routes
from edgellm.entrypoints.http.metrics import Metrics
from edgellm.entrypoints.http.schemas import ChatRequest, CompletionRequest
from edgellm.entrypoints.http.gateway import Gateway, Submitted, cancel
from edgellm.entrypoints.http.choices import (Choice, chat_logprobs, chunk, completion_logprobs, full_response,
                                                usage_chunk)
from edgellm.entrypoints.http.structured import StreamedDeltas, Structure, structure
from edgellm.entrypoints.http.upstream import Upstream, UpstreamError, allowed, mark, served_by_cloud
from edgellm.serving.handle import DONE, Handle, Request as ServiceRequest
from edgellm.serving.router import Catalog, Router
from edgellm.serving.service import Service

log = logging.getLogger("edgellm.entrypoints.http")


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str, code: str | None = None, headers: dict | None = None):
        self.status, self.message, self.kind, self.code, self.headers = status, message, kind, code, headers or {}


def _error_response(error: APIError) -> JSONResponse:
    body = {"error": {"message": error.message, "type": error.kind, "param": None, "code": error.code}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def _translate(error: BaseException) -> APIError:
    """Our typed errors -> HTTP. Anything else is a bug: a 500, its traceback in the log
    (exception type and stack only; the message may quote user text)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, Busy):
        return APIError(429, str(error), "rate_limit_exceeded", "busy", {"Retry-After": "1"})
    if isinstance(error, ModelNotFound):
        return APIError(404, str(error), "invalid_request_error", "model_not_found")
    if isinstance(error, ContextOverflow):
        return APIError(400, str(error), "invalid_request_error", "context_length_exceeded")
    if isinstance(error, InvalidRequest):
        return APIError(400, str(error), "invalid_request_error")
    if isinstance(error, OutOfMemoryBudget):
        return APIError(503, str(error), "server_error", "insufficient_memory", {"Retry-After": "1"})
    if isinstance(error, EdgeLLMError):
        return APIError(503, str(error), "server_error", type(error).__name__)
    log.error("internal error %s", type_and_stack(error))
    return APIError(500, "internal error", "server_error")


UI = Path(__file__).parent / "ui"  # the chat page at /: static files, no build step, nothing from a CDN
UI_FILES = {"app.js": "text/javascript", "style.css": "text/css", "index.html": "text/html"}
WARMUP_MIN_AVAILABLE = 512 * 2**20  # skip warmup when the device has less free memory than this
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming response checks its client is still there


class _ClientWatch:
    """Whether a client has hung up, asked of the server at most every DISCONNECT_POLL_S
    (a streaming response learns it from Starlette; a waiting one must ask)."""

    def __init__(self, request: Request):
        self.request, self.checked = request, time.perf_counter()

    async def gone(self) -> bool:
        if time.perf_counter() - self.checked < DISCONNECT_POLL_S:
            return False
        self.checked = time.perf_counter()
        return await self.request.is_disconnected()


# Paths open without the API key: liveness, the chat page and its files (the page asks for the key
# itself), FastAPI's API pages; /metrics too unless protect_metrics.
OPEN_PATHS = ("/health", "/", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")
OPEN_PREFIXES = ("/ui/",)


def key_matches(headers: dict[str, str], api_key: str) -> bool:
    """`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's), compared in
    constant time."""
    offered = headers.get("authorization", "")
    bearer = offered[7:] if offered[:7].lower() == "bearer " else ""
    expected = api_key.encode()
    return hmac.compare_digest(bearer.encode(), expected) | hmac.compare_digest(
        headers.get("x-api-key", "").encode(), expected)


class _AuthAndLog:
    """Checks the API key on every path but the open ones and logs one line per request: id,
    method, path, status, size and time, never text."""

    def __init__(self, app, api_key: str | None, metrics: Metrics, protect_metrics: bool = False):
        self.app, self.api_key, self.metrics = app, api_key, metrics
        self.protect_metrics = protect_metrics

    def _open(self, path: str) -> bool:
        return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES) or (path == "/metrics" and not self.protect_metrics)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid, start, status = uuid.uuid4().hex[:12], time.perf_counter(), [0]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        preflight = scope.get("method") == "OPTIONS"  # CORS asks before it sends the key
        if self.api_key and not preflight and not self._open(path) and not key_matches(headers, self.api_key):
            self.metrics.errors.labels("401").inc()
            response = _error_response(APIError(401, "invalid API key", "invalid_request_error", "invalid_api_key"))
            return await response(scope, receive, send)

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            log.info("request %s %s %s status=%s bytes_in=%s %.3fs", rid, scope.get("method"), path, status[0],
                     headers.get("content-length", "0"), time.perf_counter() - start)


def create_app(model=None, *, model_id: str | None = None, catalog: Catalog | None = None,
               api_key: str | None = None, queue_limit: int = 3, timeout_s: float = 15.0, log_text: bool = False,
               warmup_delay_s: float | None = None, thermal=None, max_batch: int = 1, start_engine: bool = True,
               fallback_model=None, upstream: Upstream | None = None, protect_metrics: bool = False,
               cors_origins: tuple[str, ...] = (), kv_dir: str | Path | None = None) -> FastAPI:
    """The server of one loaded `model` (answering as `model_id`; start_engine False: the caller runs
    `app.state.service.run_forever()`), or of a `catalog` of models loaded on demand, each with its
    own engine thread (serving/router.py). `upstream`: the opt-in cloud fallback (upstream.py)."""
    metrics = Metrics()

    def finished(handle: Handle, done: Completion) -> None:
        if handle.request.warmup:
            return
        t = done.timings
        metrics.requests.labels(done.finish_reason).inc()
        metrics.timeouts.inc() if done.finish_reason == "timeout" else None
        if t.ttft_s > 0:
            metrics.ttft.observe(t.ttft_s)
        if t.decode_tokens_per_s > 0:
            metrics.decode.observe(t.decode_tokens_per_s)
        if t.prefill_tokens_per_s > 0:
            metrics.prefill.observe(t.prefill_tokens_per_s)
        metrics.queue_wait.observe(handle.queue_wait_s)
        metrics.tokens.labels("prompt").inc(t.prompt_tokens)
        metrics.tokens.labels("prompt_from_prefix_cache").inc(t.prefix_hit_tokens)
        metrics.tokens.labels("completion").inc(t.completion_tokens)
        if t.speculative:
            metrics.speculative.labels("drafted").inc(t.drafted_tokens)
            metrics.speculative.labels("accepted").inc(t.accepted_tokens)
            metrics.passes.inc(t.target_passes)
        for reason in handle.degraded:
            metrics.degrades.labels(reason).inc()

    def make_service(served, start: bool = False) -> Service:
        return Service(served, queue_limit=queue_limit, default_timeout_s=timeout_s, on_finish=finished,
                       thermal=thermal, max_batch=max_batch, start=start, fallback_model=fallback_model)

    if catalog is None:
        if model is None or model_id is None:
            raise InvalidRequest("create_app needs a model and its id, or a catalog")
        router = Router.of_model(model_id, model, make_service(model, start=start_engine))
    else:
        router = Router(catalog.deployments, catalog.load, make_service, budget=catalog.budget,
                        footprint=catalog.footprint, baseline=catalog.baseline, keep_alive_s=catalog.keep_alive_s)
        for name in catalog.preload:  # a model that cannot load fails the start, not a first request
            router.release(router.acquire(name))
    primary = router.deployments[router.names()[0]]
    service = primary.current.service if primary.current is not None else None
    app = FastAPI(title="edgellm", version="0.1.0")
    app.state.service, app.state.metrics, app.state.router = service, metrics, router
    app.state.warmup = _schedule_warmup(service, metrics, warmup_delay_s) if service is not None else None
    app.state.reaper = _Reaper(router) if catalog is not None else None

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError):
        metrics.errors.labels(str(error.status)).inc()
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        metrics.errors.labels("400").inc()
        if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
            reason = (first.get("ctx") or {}).get("error", "JSON decode error")
            return _error_response(APIError(400, f"the request body is not valid JSON ({reason})", "invalid_request_error"))
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        problem = str(first.get("msg", "bad value")).removeprefix("Value error, ")
        return _error_response(APIError(400, f"invalid request: {where + ': ' if where else ''}{problem}",
                                        "invalid_request_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException):
        # Unknown routes, wrong methods, bodies that do not decode: the same OpenAI shape.
        metrics.errors.labels(str(error.status_code)).inc()
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return _error_response(APIError(error.status_code, str(error.detail), kind))

    @app.exception_handler(Exception)
    async def _internal(_: Request, error: Exception):
        api_error = _translate(error)
        metrics.errors.labels(str(api_error.status)).inc()
        return _error_response(api_error)

    # A plain ASGI middleware, not @app.middleware("http"): that wrapper runs the response in
    # another task, which kept a client's disconnect from reaching the streaming response.
    app.add_middleware(_AuthAndLog, api_key=api_key, metrics=metrics, protect_metrics=protect_metrics)
    if cors_origins:  # off unless asked: a page on another origin cannot call the server
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"])

    def api_error(status: int, message: str, code: str) -> APIError:
        return APIError(status, message, "invalid_request_error", code)

    add_adapter_routes(app, router, api_key, api_error)
    add_admin_routes(app, router, api_key, api_error, metrics)
    add_token_routes(app, router, api_error)
    add_embedding_routes(app, router, _translate, api_error)
    add_kv_routes(app, router, Path(kv_dir) if kv_dir is not None else cache_dir() / "kv", api_key, api_error, _translate)

    async def submit(prompts: list, body, chat: bool) -> Submitted:
        """Each prompt's `n` choices queued (all or none: a full queue refuses the request), the
        model id they answer as (name or name:adapter), what the request asked of the output's
        structure, and the model (its tokenizer shapes log-probabilities)."""
        try:
            deployment, named = router.find(body.model)
            version = await anyio.to_thread.run_sync(router.acquire, deployment.name)  # may load it
        except EdgeLLMError as error:
            raise _translate(error) from None
        choices: list[Choice] = []
        try:
            served = version.model
            asked = structure(body, served.template.tool_format)
            answered, adapter = pick_adapter(served, deployment.name, named, body.edgellm and body.edgellm.adapter)
            picked = {} if adapter is None else {"adapter": adapter}  # the object: an unload meanwhile cannot fail it
            sampling = body.sampling() | asked.sampling() | picked | _logprob_options(body)
            for i, prompt in enumerate(prompts):
                for k in range(body.n):
                    seeded = sampling if body.seed is None else sampling | {"seed": (body.seed + k) % 2**63}
                    request = ServiceRequest(prompt, seeded, chat, timeout_s, tools=asked.tools)
                    # tokenizing (and trimming a long conversation) runs off the event loop
                    handle = await anyio.to_thread.run_sync(version.service.submit, request)
                    echo = _echo_text(served, prompt) if getattr(body, "echo", False) else None
                    choices.append(Choice(len(choices), handle, i, echo))
        except Busy as error:
            metrics.busy.inc()
            cancel(choices)
            raise _translate(error) from None
        except EdgeLLMError as error:
            cancel(choices)
            raise _translate(error) from None
        except BaseException:
            cancel(choices)
            raise
        finally:  # once submitted, the service's own count keeps the version from unloading
            router.release(version)
        metrics.queue_depth.set(_queue_depth(router))
        if log_text:
            log.debug("prompts %r", prompts)
        return Submitted(choices, answered, asked, served.tokenizer)

    @app.get("/", include_in_schema=False)
    async def chat_page():
        return FileResponse(UI / "index.html", media_type="text/html")

    @app.get("/ui/{name}", include_in_schema=False)
    async def chat_page_file(name: str):
        kind = UI_FILES.get(name)
        if kind is None:
            raise APIError(404, f"no page file {name!r}", "invalid_request_error")
        return FileResponse(UI / name, media_type=kind)

    @app.get("/health")
    async def health():
        loaded = router.loaded()
        return {"status": "ok", "model": router.names()[0], "models_loaded": [name for name, _ in loaded],
                "queue_depth": _queue_depth(router), "busy": any(v.service.busy for _, v in loaded)}

    @app.get("/metrics")
    async def prometheus():
        metrics.queue_depth.set(_queue_depth(router))
        used = cached = 0
        for _, version in router.loaded():
            kv_used, kv_cached = version.service.kv_bytes
            used, cached = used + kv_used, cached + kv_cached
        metrics.kv_bytes.set(used)
        metrics.prefix_bytes.set(cached)
        metrics.peak_rss.set(peak_rss_bytes())
        metrics.models_loaded.set(len(router.loaded()))
        metrics.model_events.labels("load").set(router.loads)
        metrics.model_events.labels("evict").set(router.evictions)
        metrics.model_events.labels("keep_alive_unload").set(router.unloads)
        if thermal is not None:
            state = thermal.state()
            metrics.temperature.set(state.temperature_c if state.temperature_c is not None else float("nan"))
            metrics.thermal_events.labels("throttle").set(thermal.throttle_events)
            metrics.thermal_events.labels("restore").set(thermal.restore_events)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        data = []
        for name in router.names():
            current = router.deployments[name].current
            loaded = current is not None and current.service is not None
            data.append(model_entry(name))
            data += [model_entry(name, a) for a in current.model.adapters] if loaded else []
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        try:
            deployment, adapter = router.find(model_id)
        except ModelNotFound as error:
            raise _translate(error) from None
        current = deployment.current
        loaded = current is not None and current.service is not None
        if adapter is None:
            return model_entry(deployment.name)
        if loaded:
            for resident in current.model.adapters:
                if resident.name == adapter:
                    return model_entry(deployment.name, resident)
        raise APIError(404, f"model {model_id!r} does not exist", "invalid_request_error", "model_not_found")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        async def here():
            return await _respond(await submit([[m.plain() for m in body.messages]], body, True), body,
                                  "chat.completion", request)
        return await _here_or_upstream(body, request, "chat/completions", here)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        async def here():
            return await _respond(await submit(body.prompt, body, False), body, "text_completion", request)
        return await _here_or_upstream(body, request, "completions", here)

    async def _here_or_upstream(body, request: Request, route: str, here):
        """The local answer, or the upstream's for a request that allows it when the device cannot
        answer (upstream.py); the local answer again when the upstream cannot be reached."""
        may_leave = upstream is not None and allowed(body.edgellm)
        if may_leave and "hot" in upstream.on and thermal is not None and thermal.state().hot:
            forwarded = await _forward(body, request, route, "hot")
            if forwarded is not None:
                return forwarded
        try:
            return await here()
        except APIError as error:
            reason = upstream.reason(error.code) if may_leave else None
            forwarded = await _forward(body, request, route, reason) if reason else None
            if forwarded is None:
                raise
            return forwarded

    async def _forward(body, request: Request, route: str, reason: str):
        payload = await request.json()
        payload.pop("edgellm", None)
        try:
            response = await anyio.to_thread.run_sync(upstream.open, route, payload)
            if not body.stream:
                data = await anyio.to_thread.run_sync(response.read)
                response.close()
                answer = json.loads(data) | {"edgellm": served_by_cloud(reason)}
        except (UpstreamError, ValueError, TypeError, OSError) as error:
            log.warning("cloud fallback (%s) failed: %s", reason, error)
            metrics.fallbacks.labels(reason, "unreachable").inc()
            return None
        metrics.fallbacks.labels(reason, "served").inc()
        headers = {"X-Edgellm-Served-By": "cloud"}
        if not body.stream:
            return JSONResponse(answer, headers=headers)

        async def relay() -> AsyncIterator[bytes]:
            try:
                while line := await anyio.to_thread.run_sync(response.readline):
                    yield mark(line, reason)
            finally:
                response.close()

        return StreamingResponse(relay(), media_type="text/event-stream", headers=headers)

    async def _respond(sub: Submitted, body, kind: str, request: Request):
        rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            try:  # the first event decides the status: a bad prompt is a 400, not a broken stream
                first = await _next(sub.choices[0].handle, _ClientWatch(request))
            except BaseException:
                cancel(sub.choices)
                raise
            return StreamingResponse(_sse(sub, first, rid, kind, include_usage), media_type="text/event-stream")
        client = _ClientWatch(request)
        try:
            dones = [await _completion(c.handle, client) for c in sub.choices]
        finally:
            cancel(sub.choices)
        return full_response(rid, kind, sub.answered, sub.choices, dones, sub.asked, sub.tokenizer)

    async def _next(handle: Handle, client: _ClientWatch | None = None):
        """The handle's next event; a watched client that hung up meanwhile cancels it."""
        while True:
            try:
                event = await handle.next_event_async(DISCONNECT_POLL_S)
            except Exception as error:
                raise _translate(error) from None
            if client is not None and await client.gone():
                handle.cancel()
                raise APIError(499, "the client closed the connection", "invalid_request_error", "client_closed")
            if event is not None:
                return event

    async def _completion(handle: Handle, client: _ClientWatch) -> Completion:
        while True:
            event = await _next(handle, client)
            if isinstance(event, Completion):
                return event

    async def _sse(sub: Submitted, first, rid: str, kind: str, include_usage: bool) -> AsyncIterator[str]:
        """The choices' events as chunks, in the order they come (each chunk names its choice)."""
        created, chat = int(time.time()), kind == "chat.completion"
        merged: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(_pump(c, merged, first if c.index == 0 else None)) for c in sub.choices]
        deltas = [StreamedDeltas(sub.asked) for _ in sub.choices]
        dones: list[Completion | None] = [None] * len(sub.choices)
        try:
            for c in sub.choices:
                if chat:
                    yield chunk(rid, created, sub.answered, c.index, {"role": "assistant", "content": ""}, None, chat)
                elif c.echo:
                    yield chunk(rid, created, sub.answered, c.index, c.echo, None, chat)
            ended = 0
            while ended < len(sub.choices):
                c, event = await merged.get()
                if isinstance(event, APIError):
                    yield f"data: {json.dumps({'error': {'message': event.message, 'type': event.kind}})}\n\n"
                    return
                if event is DONE:
                    ended += 1
                    continue
                for line in _event_chunks(sub, c, event, deltas[c.index], rid, created, chat):
                    yield line
                if isinstance(event, Completion):
                    dones[c.index] = event
            if include_usage and all(dones):
                yield usage_chunk(rid, created, sub.answered, sub.choices, dones, chat)
            yield "data: [DONE]\n\n"
        finally:
            for pump in pumps:
                pump.cancel()
            cancel(sub.choices)  # a disconnected client frees its slots and KV now

    async def _pump(choice: Choice, merged: asyncio.Queue, first) -> None:
        event = first
        try:
            while True:
                event = event if event is not None else await _next(choice.handle)
                await merged.put((choice, event))
                if event is DONE:
                    return
                event = None
        except APIError as error:
            await merged.put((choice, error))

    gateway = Gateway(submit=submit, next_event=_next, client_watch=_ClientWatch, api_error=APIError)
    add_anthropic_routes(app, gateway)
    add_responses_routes(app, gateway)
    return app


def _queue_depth(router: Router) -> int:
    return sum(version.service.queue_depth for _, version in router.loaded())


class _Reaper:
    """Unloads models idle past their keep-alive time, and closes swapped-out versions once their
    last request ends, every `period_s`."""

    def __init__(self, router: Router, period_s: float = 1.0):
        self.router, self.stop = router, threading.Event()
        thread = threading.Thread(target=self._run, args=(period_s,), name="edgellm-reaper", daemon=True)
        thread.start()

    def _run(self, period_s: float) -> None:
        while not self.stop.wait(period_s):
            try:
                self.router.reap()
            except Exception as error:  # noqa: BLE001 - the next round tries again
                log.error("unloading idle models failed: %s", type_and_stack(error))


def _schedule_warmup(service: Service, metrics: Metrics, delay_s: float | None):
    """A short background inference after start, so the first real request finds kernels,
    caches and pages warm; skipped when free memory is short."""
    if delay_s is None:
        return None

    def warm() -> None:
        import psutil

        if psutil.virtual_memory().available < WARMUP_MIN_AVAILABLE:
            metrics.warmups.labels("skipped").inc()
            return
        try:
            for _ in service.submit(ServiceRequest("Hello", {"max_tokens": 4, "temperature": 0.0}, warmup=True)):
                pass
            metrics.warmups.labels("done").inc()
        except Exception:  # busy already: real traffic warms it
            metrics.warmups.labels("skipped").inc()

    timer = threading.Timer(delay_s, warm)
    timer.daemon = True
    timer.start()
    return timer


def _logprob_options(body) -> dict:
    """The generation's logprobs / prompt_logprobs from a chat or completions body."""
    if isinstance(body, ChatRequest):
        return {"logprobs": body.top_logprobs or 0} if body.logprobs else {}
    if body.logprobs is None:
        return {}
    return {"logprobs": body.logprobs} | ({"prompt_logprobs": body.logprobs} if body.echo else {})


def _echo_text(model, prompt) -> str:
    return prompt if isinstance(prompt, str) else model.tokenizer.decode(list(prompt))


def _event_chunks(sub: Submitted, c: Choice, event, deltas: StreamedDeltas, rid: str, created: int,
                  chat: bool) -> list[str]:
    """A choice's stream chunks for one event: a token's text (and its log-probability), or the end."""
    if isinstance(event, TokenEvent):
        logprobs = None if event.logprob is None else (
            chat_logprobs(sub.tokenizer, [event.logprob]) if chat else
            completion_logprobs(sub.tokenizer, [event.logprob]))
        pieces = deltas.push(event.text)
        if logprobs is not None and not pieces:
            pieces = [{"content": ""}]  # the token's log-probability even while its text is held back
        return [chunk(rid, created, sub.answered, c.index, d, None, chat, logprobs if i == 0 else None)
                for i, d in enumerate(pieces)]
    held, finish_reason = deltas.finish(event.finish_reason)
    lines = [chunk(rid, created, sub.answered, c.index, d, None, chat) for d in deltas.push(event.tail) + held]
    return lines + [chunk(rid, created, sub.answered, c.index, None, finish_reason, chat)]
