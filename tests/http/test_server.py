"""The OpenAI-compatible server, driven by the official openai client and raw HTTP."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

import httpx
import openai
import pytest

from tests.http.conftest import MODEL_ID


def _client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


CHAT = [{"role": "user", "content": "Name three colors."}]


def test_chat_stream_equals_non_stream_and_usage_arrives(server):
    client = _client(server)
    full = client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=24)
    text = full.choices[0].message.content
    assert text and full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_completions_endpoint_and_stop_strings(server):
    client = _client(server)
    free = client.completions.create(model=MODEL_ID, prompt="1, 2, 3, 4, 5,", temperature=0, max_tokens=20)
    assert " 7," in free.choices[0].text
    stopped = client.completions.create(model=MODEL_ID, prompt="1, 2, 3, 4, 5,", temperature=0, max_tokens=20,
                                        stop=[" 7,"])
    assert stopped.choices[0].text == free.choices[0].text.split(" 7,")[0]
    assert stopped.choices[0].finish_reason == "stop"


def test_async_streaming_keeps_emoji_and_cjk_intact(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL_ID, temperature=0, max_tokens=40, stream=True,
            messages=[{"role": "user", "content": "Repeat exactly: 你好，世界！🎉👩‍👩‍👧"}])
        return [c.choices[0].delta.content or "" async for c in stream if c.choices]
    pieces = asyncio.run(run())
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces)


def test_responses_carry_per_request_timings(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL_ID, "prompt": "Hello", "max_tokens": 8},
                   timeout=60).json()
    report = r["edgellm"]
    assert report["ttft_s"] > 0 and report["decode_tokens_per_s"] > 0 and report["prefill_tokens_per_s"] > 0
    assert report["queue_wait_s"] >= 0 and report["peak_rss_bytes"] > 0 and report["degraded"] == []


def test_speculation_is_chosen_per_request_with_the_same_text(server):
    repeating = ("The server answers on port 8000 and keeps its prompts private. " * 4
                 + "Repeat the text above word for word.")
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": repeating}], "max_tokens": 40,
            "temperature": 0}
    post = lambda extra: httpx.post(server.url + "/v1/chat/completions", json=body | extra, timeout=120).json()  # noqa: E731
    plain, spec, off = post({}), post({"edgellm": {"speculative": "lookup"}}), post({"edgellm": {"speculative": "off"}})
    text = plain["choices"][0]["message"]["content"]
    assert spec["choices"][0]["message"]["content"] == text == off["choices"][0]["message"]["content"]
    assert spec["edgellm"]["speculative"] == "lookup" and spec["edgellm"]["drafted_tokens"] > 0
    assert 0 < spec["edgellm"]["acceptance_rate"] <= 1 and spec["edgellm"]["tokens_per_pass"] > 1
    assert off["edgellm"]["speculative"] == ""
    metrics = httpx.get(server.url + "/metrics").text
    assert 'edgellm_speculative_tokens_total{outcome="accepted"}' in metrics
    bad = httpx.post(server.url + "/v1/chat/completions", json=body | {"edgellm": {"speculative": "magic"}}, timeout=30)
    assert bad.status_code == 400


def test_speculating_requests_batched_with_others_keep_their_text(server_factory):
    # throughput mode: a speculating request decodes in a batch while others run (plain steps) and
    # checks guesses whenever it runs alone; its text must not change either way
    server = server_factory(max_batch=3)
    prompts = [("The river flows past the old mill and under the stone bridge. " * 3
                + "Repeat the text above word for word."), "Name three colors.", "Count from one to ten."]
    bodies = [{"model": MODEL_ID, "messages": [{"role": "user", "content": p}], "max_tokens": 40, "temperature": 0}
              for p in prompts]
    post = lambda body: httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()  # noqa: E731
    alone = [post(b)["choices"][0]["message"]["content"] for b in bodies]
    speculating = [b | {"edgellm": {"speculative": "lookup"}} for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        together = list(pool.map(post, speculating))
    assert [r["choices"][0]["message"]["content"] for r in together] == alone
    assert all(r["edgellm"]["speculative"] == "lookup" for r in together)


def test_models_health_and_metrics(server):
    client = _client(server)
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=4)
    metrics = httpx.get(server.url + "/metrics").text
    assert "edgellm_ttft_seconds_bucket" in metrics and "edgellm_requests_total" in metrics


@pytest.mark.parametrize("body, code", [
    ({"model": MODEL_ID, "messages": CHAT, "temperature": -1}, "invalid_request_error"),
    ({"model": MODEL_ID, "messages": []}, "invalid_request_error"),
    ({"model": MODEL_ID, "messages": CHAT, "n": 17}, "invalid_request_error"),
        ({"model": MODEL_ID, "messages": CHAT, "audio": {"voice": "alloy"}}, "invalid_request_error"),
    ({"model": MODEL_ID, "messages": [{"role": "wizard", "content": "hi"}]}, "invalid_request_error"),
])
def test_invalid_fields_are_400(server, body, code):
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["type"] == code


def test_unknown_fields_are_ignored(server):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL_ID, "messages": CHAT, "max_tokens": 2, "frequency_penalty": 0.5, "logit_bias": {}})
    assert r.status_code == 200


def test_bad_json_bad_utf8_unknown_model_and_overflow(server):
    url = server.url + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the request body is not valid JSON")
    bad_utf8 = b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    assert httpx.post(url, content=bad_utf8, headers={"content-type": "application/json"}).status_code == 400
    r = httpx.post(url, json={"model": "gpt-4", "messages": CHAT})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    long = {"model": MODEL_ID, "messages": [{"role": "user", "content": "word " * 9000}]}
    r = httpx.post(url, json=long, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "8192" in r.json()["error"]["message"]
    r = httpx.post(url, json=long | {"stream": True}, timeout=120)
    assert r.status_code == 400
    assert httpx.get(server.url + "/health").json()["status"] == "ok"  # the service survived


def test_api_key(server_factory):
    server = server_factory(api_key="s3cret")
    with pytest.raises(openai.AuthenticationError):
        _client(server, api_key="wrong").models.list()
    assert [m.id for m in _client(server, api_key="s3cret").models.list()] == [MODEL_ID]
    assert httpx.get(server.url + "/health").status_code == 200  # health stays open


def test_timeout_returns_partial_text(server_factory):
    server = server_factory(timeout_s=0.5)
    done = _client(server).completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=2000,
                                              temperature=0)
    assert done.choices[0].finish_reason == "timeout" and done.choices[0].text
    assert done.usage.prompt_tokens == 4 and done.usage.completion_tokens > 0
    assert 'edgellm_timeouts_total 1.0' in httpx.get(server.url + "/metrics").text


def test_client_disconnect_frees_the_slot(server, served_model):
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": MODEL_ID, "prompt": "Tell a long story.", "max_tokens": 2000, "stream": True,
                            "temperature": 0}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    deadline = time.time() + 10
    while httpx.get(server.url + "/health").json()["busy"] and time.time() < deadline:
        time.sleep(0.05)
    assert not httpx.get(server.url + "/health").json()["busy"]
    assert served_model.kv.live_bytes == 0  # its KV went back to the pool (cached prefixes stay)


def test_load_twenty_clients_queue_bound_three(server_factory):
    server = server_factory(queue_limit=3)
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": 16, "temperature": 0}

    def call(_):
        start = time.perf_counter()
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        return r.status_code, time.perf_counter() - start, r.headers.get("retry-after")

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(call, range(20)))
    codes = [c for c, _, _ in results]
    assert set(codes) <= {200, 429} and codes.count(200) >= 4 and codes.count(429) >= 1
    assert all(t < 2.0 and ra == "1" for c, t, ra in results if c == 429)  # refused at once, with Retry-After
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(server.url + "/metrics").text
    assert f"edgellm_busy_rejections_total {float(codes.count(429))}" in metrics
    assert f'edgellm_requests_total{{outcome="length"}} {float(codes.count(200))}' in metrics


def test_logs_never_contain_prompt_text(server, caplog):
    secret = "my-password-is-hunter2"
    with caplog.at_level(logging.DEBUG):
        _client(server).chat.completions.create(model=MODEL_ID, max_tokens=4,
                                                messages=[{"role": "user", "content": secret}])
    assert caplog.records  # the request was logged ...
    assert all(secret not in r.getMessage() for r in caplog.records)  # ... without its text


def test_control_characters_are_stripped_but_emoji_and_cjk_kept(server):
    client = _client(server)
    clean = client.completions.create(model=MODEL_ID, prompt="你好 🎉\tok", max_tokens=1, temperature=0)
    dirty = client.completions.create(model=MODEL_ID, prompt="你\x00好 🎉\x07\t\x1bok\x7f", max_tokens=1,
                                      temperature=0)
    assert dirty.usage.prompt_tokens == clean.usage.prompt_tokens
    assert dirty.choices[0].text == clean.choices[0].text


def test_warmup_runs_in_the_background_after_start(server_factory):
    server = server_factory(warmup_delay_s=0.1)
    deadline = time.time() + 30
    while 'edgellm_warmups_total{outcome="done"} 1.0' not in httpx.get(server.url + "/metrics").text:
        assert time.time() < deadline, "warmup did not run"
        time.sleep(0.1)
    assert "edgellm_requests_total{" not in httpx.get(server.url + "/metrics").text  # no client's request yet


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma2"])
def test_the_official_client_chats_with_every_architecture(arch, tmp_path):
    import gguf

    import edgellm
    from tests.http.conftest import RunningServer
    from tests.tiny import random_weights, write_gguf

    path = write_gguf(tmp_path / f"{arch}.gguf", arch, random_weights(arch, head_dim=32, layers=4), head_dim=32,
                      layers=4, tokenizer="llama", qtype=gguf.GGMLQuantizationType.Q8_0)
    model = edgellm.load(path)
    server = RunningServer(model)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hello"}],
                                               max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
    finally:
        server.stop()
        model.close()
