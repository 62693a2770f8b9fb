"""What a fault run against `edgellm serve` found: clients that hang up, values the schema
accepts but the engine could not, bodies that do not decode, huge conversations, deadlines,
and 500s — each answered in OpenAI's error shape, counted, and never killing the service."""
from __future__ import annotations

import json
import logging
import time

import httpx
import openai
import pytest

from tests.http.conftest import MODEL_ID

# Counting goes on well past the few seconds these tests need (no end-of-text in sight).
LONG = {"model": MODEL_ID, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 2000, "temperature": 0}


def _metric(server, line_start: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_idle(server, seconds: float = 15) -> None:
    deadline = time.time() + seconds
    while httpx.get(server.url + "/health").json()["busy"]:
        assert time.time() < deadline, "the engine is still busy"
        time.sleep(0.05)


def test_streams_dropped_by_their_clients_end_as_cancelled(server_factory):
    server = server_factory(timeout_s=60)
    for _ in range(3):
        with httpx.stream("POST", server.url + "/v1/completions", json=LONG | {"stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 3:
                    break
        _wait_idle(server)
    assert _metric(server, 'edgellm_requests_total{outcome="cancelled"}') == 3


def test_a_non_streaming_client_that_hangs_up_cancels_its_request(server_factory):
    server = server_factory(timeout_s=60)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(5, read=1.0))
    _wait_idle(server)
    assert _metric(server, 'edgellm_requests_total{outcome="cancelled"}') == 1


def test_values_the_schema_allows_are_handled_or_400(server):
    url = server.url + "/v1/completions"
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4}
    r = httpx.post(url, json=body | {"seed": 18446744073709551616}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, json=body | {"temperature": 1e-300}, timeout=60)  # as good as greedy
    greedy = httpx.post(url, json=body | {"temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    r = httpx.post(url, json=body | {"max_tokens": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("content, status", [(b"\xff\xfe\x00garbage", 400), (b"[" * 10_000 + b"]" * 10_000, 400)])
def test_bodies_that_do_not_decode_get_the_openai_error_shape(server, content, status):
    before = _metric(server, f'edgellm_errors_total{{status="{status}"}}')
    r = httpx.post(server.url + "/v1/chat/completions", content=content,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status and set(r.json()["error"]) >= {"message", "type", "code"}
    assert _metric(server, f'edgellm_errors_total{{status="{status}"}}') == before + 1


def test_unknown_routes_get_the_openai_error_shape(server):
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert _metric(server, 'edgellm_errors_total{status="404"}') >= 1


def test_a_hundred_long_turns_are_trimmed_in_one_pass(server):
    turns = []
    for i in range(50):
        turns += [{"role": "user", "content": f"Part {i}. " + "The harbour light turns. " * 140},
                  {"role": "assistant", "content": "Noted."}]
    turns.append({"role": "user", "content": "Summarize the last part in one line."})
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL_ID, "messages": turns, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and "context_truncated" in r.json()["edgellm"]["degraded"]
    assert r.json()["usage"]["prompt_tokens"] < 8192  # SmolLM2's context


def test_a_prompt_beyond_the_context_is_a_400_naming_its_size(smollm2_path):
    import edgellm

    from tests.http.conftest import RunningServer

    model = edgellm.load(smollm2_path, context_length=512)
    server = RunningServer(model)
    try:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL_ID, "max_tokens": 4,
            "messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "word " * 600}]})
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "context_length_exceeded"
        whole = len(model.template.encode_chat([{"role": "user", "content": "word " * 400},
                                                {"role": "assistant", "content": "ok"},
                                                {"role": "user", "content": "word " * 600}]))
        assert f"prompt has {whole} tokens" in error["message"]
    finally:
        server.stop()
        model.close()


def test_an_internal_error_is_a_500_with_its_traceback_logged(server, caplog, monkeypatch):
    def broken(request):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(server.app.state.service, "submit", broken)
    with caplog.at_level(logging.ERROR, logger="edgellm.entrypoints.http"):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL_ID, "prompt": "hi"}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    logged = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "ZeroDivisionError" in logged and "test_faults.py" in logged  # type and stack, not the text
    assert httpx.get(server.url + "/health").status_code == 200


def test_official_client_meets_prefix_reuse_by_default(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    system = {"role": "system", "content": "You answer questions about lighthouses. " * 40}
    replies = [client.chat.completions.create(model=MODEL_ID, max_tokens=2, temperature=0,
                                              messages=[system, {"role": "user", "content": question}])
               for question in ("Who keeps it?", "How tall is it?")]
    hits = [r.model_extra["edgellm"]["prefix_hit_tokens"] for r in replies]
    assert hits[1] >= 256 and hits[1] > hits[0]  # the shared system prompt was not prefilled again
    assert _metric(server, 'edgellm_tokens_total{kind="prompt_from_prefix_cache"}') >= sum(hits)
    assert _metric(server, "edgellm_prefix_cache_bytes") > 0
    assert json.dumps(replies[1].model_dump())  # still a plain OpenAI response
