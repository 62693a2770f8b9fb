"""The opt-in cloud fallback: an upstream OpenAI-compatible server answers the requests this device
cannot (its queue is full, the prompt is over its context, the model is not served here, memory is
short, the device is hot: each may be switched off), and only requests that allow it
(`edgellm.cloud_fallback: true`) and are not marked private (`edgellm.private: true`). Nothing
leaves the device otherwise. An upstream that cannot be reached in `connect_timeout_s` gives the
client the local answer (the error, or a hot device's slower reply), never a hang."""
from __future__ import annotations

import http.client
import json
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from edgellm.errors import EdgeLLMError, InvalidRequest

REASONS = ("busy", "context", "model", "memory", "hot")
# the local error's code -> the fallback reason it is
_REASON_OF_CODE = {"busy": "busy", "context_length_exceeded": "context", "model_not_found": "model",
                   "insufficient_memory": "memory"}
MAX_ERROR_BODY = 1 << 16


class UpstreamError(EdgeLLMError):
    """The upstream could not be reached or did not answer with 200."""


@dataclass(frozen=True)
class Upstream:
    base_url: str  # e.g. https://api.example.com/v1
    api_key: str | None = None
    on: frozenset[str] = frozenset(REASONS)
    model: str | None = None  # the upstream's model id; None: the request's
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 120.0

    def __post_init__(self):
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequest(f"--fallback-url {self.base_url!r}: expected an http(s):// URL of an OpenAI API")
        unknown = set(self.on) - set(REASONS)
        if unknown:
            raise InvalidRequest(f"--fallback-on: unknown reason(s) {', '.join(sorted(unknown))} "
                                 f"(choose from {', '.join(REASONS)})")

    def reason(self, code: str | None) -> str | None:
        """The fallback reason for a local error's code, if this upstream takes it."""
        reason = _REASON_OF_CODE.get(code or "")
        return reason if reason in self.on else None

    def open(self, route: str, payload: dict) -> http.client.HTTPResponse:
        """POST `payload` to the upstream's `route` ("chat/completions"); the response, its status 200.
        UpstreamError for anything else (unreachable, a timeout, another status)."""
        parts = urlsplit(self.base_url)
        body = dict(payload, model=self.model or payload.get("model"))
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        extra = {"context": ssl.create_default_context()} if parts.scheme == "https" else {}
        conn = cls(parts.hostname, parts.port, timeout=self.connect_timeout_s, **extra)
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            conn.connect()
            conn.sock.settimeout(self.read_timeout_s)
            conn.request("POST", parts.path.rstrip("/") + "/" + route, body=json.dumps(body), headers=headers)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise UpstreamError(f"the fallback upstream is unreachable: {e or type(e).__name__}") from None
        if response.status != 200:
            detail = response.read(MAX_ERROR_BODY)[:300].decode("utf-8", "replace")
            conn.close()
            raise UpstreamError(f"the fallback upstream answered HTTP {response.status}: {detail}")
        return response


def allowed(options) -> bool:
    """Whether a request's `edgellm` options let it leave the device."""
    return bool(options is not None and options.cloud_fallback and not options.private)


def mark(chunk: bytes, reason: str) -> bytes:
    """One SSE line of the upstream's stream with edgellm.served_by added to its JSON."""
    if not chunk.startswith(b"data: ") or chunk.strip() == b"data: [DONE]":
        return chunk
    try:
        body = json.loads(chunk[6:])
    except ValueError:
        return chunk
    if isinstance(body, dict):
        body["edgellm"] = served_by_cloud(reason)
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n"


def served_by_cloud(reason: str) -> dict:
    return {"served_by": "cloud", "fallback_reason": reason}
