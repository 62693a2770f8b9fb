"""The opt-in cloud fallback against a second edgellm server on 127.0.0.1 as the "cloud": taken only
by requests that allow it and are not private, for the reasons the server allows; streamed the same
way; counted; and an unreachable upstream gives the local answer at once."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest

import edgellm
from edgellm.entrypoints.http.upstream import Upstream
from tests.http.conftest import MODEL_ID, RunningServer

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
CLOUD = {"edgellm": {"cloud_fallback": True}}
LOCAL_ID = "device-model"


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def ask(server, model: str = LOCAL_ID, extra: dict | None = None, stream: bool = False, messages=PROMPT):
    return client(server).chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                  stream=stream, extra_body=extra)


@pytest.fixture(scope="module")
def cloud(served_model):
    server = RunningServer(served_model, queue_limit=8, max_batch=4, timeout_s=120)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def short_model(smollm2_path):
    """The device's model with a context of 256 tokens: longer prompts overflow here, not in the cloud."""
    model = edgellm.load(smollm2_path, context_length=256)
    yield model
    model.close()


@pytest.fixture
def device(short_model):
    servers = []

    def start(upstream: Upstream, **options) -> RunningServer:
        server = RunningServer(short_model, model_id=LOCAL_ID, upstream=upstream, queue_limit=0, max_batch=1,
                               timeout_s=120, **options)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def saturate(server) -> threading.Thread:
    """One long request holding the device's only slot (queue_limit 0) for 200 tokens."""
    started = threading.Event()

    def hold():
        stream = client(server).chat.completions.create(model=LOCAL_ID, messages=PROMPT, max_tokens=200, stream=True,
                                                        temperature=0, extra_body={"ignore_eos": True})
        for _ in stream:
            started.set()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert started.wait(60)
    return thread


def test_a_full_queue_goes_to_the_cloud_only_when_the_request_allows_it(device, cloud):
    server = device(Upstream(cloud.url + "/v1"))
    expected = ask(cloud, MODEL_ID).choices[0].message.content
    holder = saturate(server)
    with pytest.raises(openai.RateLimitError):
        ask(server)  # not allowed: the local 429
    with pytest.raises(openai.RateLimitError):
        ask(server, extra={"edgellm": {"cloud_fallback": True, "private": True}})  # private never leaves
    answer = ask(server, model=MODEL_ID, extra=CLOUD)  # the cloud serves its own model id
    assert answer.choices[0].message.content == expected
    assert answer.model_extra["edgellm"] == {"served_by": "cloud", "fallback_reason": "model"}
    assert holder.is_alive()
    holder.join(60)
    assert ask(server).model_extra["edgellm"]["served_by"] == "local"
    metrics = httpx.get(server.url + "/metrics").text
    assert 'edgellm_cloud_fallbacks_total{outcome="served",reason="model"}' in metrics


def test_busy_and_context_reasons_with_the_upstreams_model_id(device, cloud):
    server = device(Upstream(cloud.url + "/v1", model=MODEL_ID))
    expected = ask(cloud, MODEL_ID).choices[0].message.content
    holder = saturate(server)
    answer = ask(server, extra=CLOUD)
    assert answer.model_extra["edgellm"] == {"served_by": "cloud", "fallback_reason": "busy"}
    assert answer.choices[0].message.content == expected
    assert holder.is_alive()
    holder.join(60)
    long_chat = [{"role": "user", "content": "Tell me about the harbour and its old lighthouse. " * 30}]
    with pytest.raises(openai.BadRequestError):
        ask(server, messages=long_chat)  # over the device's 64 tokens, not allowed out
    answer = ask(server, extra=CLOUD, messages=long_chat)
    assert answer.model_extra["edgellm"]["fallback_reason"] == "context"


def test_a_stream_from_the_cloud_streams_the_same_way(device, cloud):
    server = device(Upstream(cloud.url + "/v1", model=MODEL_ID))
    expected = "".join(c.choices[0].delta.content or "" for c in ask(cloud, MODEL_ID, stream=True) if c.choices)
    holder = saturate(server)
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"model": LOCAL_ID, "messages": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True,
                            **CLOUD}) as response:
        assert response.headers["x-edgellm-served-by"] == "cloud"
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    holder.join(60)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["edgellm"] == {"served_by": "cloud", "fallback_reason": "busy"} for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == expected


def test_reasons_the_server_does_not_take_stay_local(device, cloud):
    server = device(Upstream(cloud.url + "/v1", model=MODEL_ID, on=frozenset({"context"})))
    holder = saturate(server)
    with pytest.raises(openai.RateLimitError):
        ask(server, extra=CLOUD)
    holder.join(60)


def test_an_unreachable_upstream_gives_the_local_error_at_once(device):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = device(Upstream(f"http://127.0.0.1:{port}/v1", connect_timeout_s=2.0))
    holder = saturate(server)
    started = time.perf_counter()
    with pytest.raises(openai.RateLimitError):
        ask(server, extra=CLOUD)
    assert time.perf_counter() - started < 5
    holder.join(60)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'edgellm_cloud_fallbacks_total{outcome="unreachable",reason="busy"} 1.0' in metrics


def test_a_hot_device_sends_allowed_requests_to_the_cloud(device, cloud, tmp_path):
    from edgellm.serving.thermal import ThermalGovernor

    sensor = tmp_path / "temp"
    sensor.write_text("90")
    server = device(Upstream(cloud.url + "/v1", model=MODEL_ID), thermal=ThermalGovernor(str(sensor), threshold_c=75))
    assert ask(server, extra=CLOUD).model_extra["edgellm"] == {"served_by": "cloud", "fallback_reason": "hot"}
    assert ask(server).model_extra["edgellm"]["served_by"] == "local"  # not allowed: answered here, throttled
