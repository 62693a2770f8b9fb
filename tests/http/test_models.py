"""Several models behind one server (serving/router.py) through a real server on 127.0.0.1 and the
official client: loaded on demand, evicted under a memory budget, unloaded after their keep-alive
time; a hot swap during a running stream, a swap to a corrupt file, a rollback."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

import edgellm
from edgellm.api.planner import parse_bytes, runtime_baseline
from edgellm.entrypoints.cli.serve import _footprint
from edgellm.serving.handle import Request
from edgellm.serving.router import Catalog, Router
from edgellm.serving.service import Service
from edgellm.store import resolve
from tests.http.conftest import RunningServer

KEY = "s3cret"
PROMPT = "The old lighthouse keeper walked down to the harbour and"


def load(ref: str, budget: int | None):
    return edgellm.load(ref, memory_budget=budget)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def admin(server, path: str, body: dict | None = None, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if body is None and path.endswith("/models"):
        return httpx.get(server.url + path, headers=headers, timeout=120)
    return httpx.post(server.url + path, json=body or {}, headers=headers, timeout=120)


def complete(server, model: str, tokens: int = 12) -> str:
    return client(server).completions.create(model=model, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text


def health(server) -> dict:
    return httpx.get(server.url + "/health").json()


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """Each built-in model's greedy continuation of PROMPT, loaded on its own."""
    out = {}
    for name in ("smollm2-135m", "gemma3-270m"):
        with edgellm.load(name) as model:
            out[name] = model.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True).text
    assert out["smollm2-135m"] != out["gemma3-270m"]
    return out


@pytest.fixture
def serve():
    servers = []

    def start(deployments: dict[str, str], **options) -> RunningServer:
        catalog = Catalog(deployments, load, preload=(next(iter(deployments)),), **options)
        servers.append(RunningServer(catalog=catalog, api_key=KEY, queue_limit=8, max_batch=4, timeout_s=120))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def test_both_models_are_listed_and_the_second_loads_on_its_first_request(serve, reference):
    server = serve({"small": "smollm2-135m", "gemma": "gemma3-270m"})
    assert [m.id for m in client(server).models.list()] == ["small", "gemma"]
    assert health(server)["models_loaded"] == ["small"]
    assert complete(server, "gemma") == reference["gemma3-270m"]
    assert complete(server, "small") == reference["smollm2-135m"]
    assert sorted(health(server)["models_loaded"]) == ["gemma", "small"]  # no budget: both stay
    with pytest.raises(openai.NotFoundError):
        complete(server, "nothing-here")


def test_a_memory_budget_unloads_the_least_recently_used(serve, reference):
    budget, baseline = parse_bytes("1000MB"), runtime_baseline()
    footprint = _footprint(budget, baseline, None, models=2)
    small, gemma = footprint(str(resolve("smollm2-135m"))), footprint(str(resolve("gemma3-270m")))
    assert max(small, gemma) <= budget - baseline < small + gemma  # room for one, not both
    server = serve({"small": "smollm2-135m", "gemma": "gemma3-270m"}, budget=budget, footprint=footprint,
                   baseline=baseline)
    assert complete(server, "gemma") == reference["gemma3-270m"]
    assert health(server)["models_loaded"] == ["gemma"]
    assert complete(server, "small") == reference["smollm2-135m"]
    assert health(server)["models_loaded"] == ["small"]
    metrics = httpx.get(server.url + "/metrics").text
    assert 'edgellm_model_events{event="evict"} 2.0' in metrics and 'edgellm_model_events{event="load"} 3.0' in metrics


def test_an_unused_model_is_unloaded_after_its_keep_alive_time(serve, reference):
    server = serve({"small": "smollm2-135m"}, keep_alive_s=0.5)
    deadline = time.time() + 10
    while health(server)["models_loaded"] and time.time() < deadline:
        time.sleep(0.1)
    assert health(server)["models_loaded"] == []
    assert complete(server, "small") == reference["smollm2-135m"]  # loaded again on demand


def test_a_load_does_not_hold_up_the_models_already_loaded(smollm2_path):
    """The second model's load is held open; the first keeps answering meanwhile."""
    release, loading = threading.Event(), threading.Event()

    def gated(ref: str, budget):
        if ref == "held":
            loading.set()
            release.wait(60)
            ref = str(smollm2_path)
        return edgellm.load(ref)

    router = Router({"first": str(smollm2_path), "second": "held"}, gated, lambda m: Service(m, start=False))
    try:
        first = router.acquire("first")
        router.release(first)
        waiting = threading.Thread(target=lambda: router.release(router.acquire("second")))
        waiting.start()
        assert loading.wait(30)
        version = router.acquire("first")
        try:
            done = version.model.generate(PROMPT, max_tokens=4, temperature=0)
            assert done.timings.completion_tokens == 4
            for event in version.service.submit(Request(PROMPT, {"max_tokens": 4, "temperature": 0.0})):
                pass
        finally:
            router.release(version)
        assert waiting.is_alive()  # the second is still loading
        release.set()
        waiting.join(60)
        assert [name for name, _ in router.loaded()] == ["first", "second"]
    finally:
        release.set()
        router.close()


def test_a_hot_swap_lets_a_running_stream_finish_on_the_old_version(serve, reference):
    server = serve({"assistant": "smollm2-135m"})
    stream = client(server).completions.create(model="assistant", prompt=PROMPT, max_tokens=300, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
    pieces = [next(iter(stream)).choices[0].text]
    swapped = admin(server, "/admin/models/assistant/swap", {"model": "gemma3-270m"})
    swapped_at = time.perf_counter()
    assert swapped.status_code == 200, swapped.text
    report = swapped.json()
    assert (report["model"], report["previous"]) == ("gemma3-270m", "smollm2-135m")
    assert report["load_s"] > 0 and report["canary_s"] > 0
    pieces += [chunk.choices[0].text for chunk in stream if chunk.choices]
    ended_at = time.perf_counter()
    assert swapped_at < ended_at
    assert "".join(pieces).startswith(reference["smollm2-135m"])  # the old version's text to the end
    with edgellm.load("smollm2-135m") as old:
        assert "".join(pieces) == old.generate(PROMPT, max_tokens=300, temperature=0, ignore_eos=True).text
    assert complete(server, "assistant") == reference["gemma3-270m"]  # new requests: the new version
    listed = admin(server, "/admin/models").json()["data"]
    assert listed == [{"id": "assistant", "model": "gemma3-270m", "state": "loaded", "previous": "smollm2-135m",
                       "load_s": listed[0]["load_s"]}]
    rolled = admin(server, "/admin/models/assistant/rollback")
    assert rolled.status_code == 200 and rolled.json()["model"] == "smollm2-135m"
    assert complete(server, "assistant") == reference["smollm2-135m"]
    deadline = time.time() + 10  # the swapped-out versions close once drained
    while len(server.app.state.router.loaded()) != 1 or server.app.state.router._draining:
        assert time.time() < deadline
        time.sleep(0.1)


def test_a_swap_to_a_broken_model_keeps_the_old_one(serve, reference, tmp_path):
    server = serve({"assistant": "smollm2-135m"})
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(1000))
    for target, status in ((str(broken), 422), ("no-such-model:v9", 422)):
        answer = admin(server, "/admin/models/assistant/swap", {"model": target})
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert error["code"] == "swap_failed" and "still serves smollm2-135m" in error["message"]
        assert complete(server, "assistant") == reference["smollm2-135m"]
    assert admin(server, "/admin/models/assistant/rollback").status_code == 400  # nothing to roll back to
    assert 'edgellm_swaps_total{outcome="failed"} 3.0' in httpx.get(server.url + "/metrics").text
    assert server.app.state.router.held_bytes == 0


def test_admin_routes_need_the_key(serve, server_factory):
    keyed = serve({"assistant": "smollm2-135m"})
    assert admin(keyed, "/admin/models", key=None).status_code == 401
    assert admin(keyed, "/admin/models/assistant/swap", {"model": "gemma3-270m"}, key="wrong").status_code == 401
    assert admin(keyed, "/admin/models/nobody/swap", {"model": "gemma3-270m"}).status_code == 404
    open_server = server_factory()  # no API key: the admin routes are off
    assert admin(open_server, "/admin/models", key=None).status_code == 403
