"""LoRA adapters over the served model: picked per request by model id ("base:adapter") or the
edgellm.adapter field, listed in /v1/models, loaded and unloaded at run time through
/v1/adapters (only with the server's API key), an unload never cutting a running request short,
and requests under different adapters batched together answering as each would alone."""
from __future__ import annotations

import concurrent.futures
import threading

import httpx
import openai
import pytest

from edgellm.lora.peft_io import random_adapter
from tests.http.conftest import MODEL_ID

KEY = "sekret"
CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def adapter_paths(tmp_path_factory, served_model):
    root = tmp_path_factory.mktemp("served-adapters")
    return {name: random_adapter(root / name, served_model.config, rank=16, std=0.05, seed=seed)
            for seed, name in enumerate(["polish", "translate"], start=1)}


@pytest.fixture
def keyed(server_factory, served_model):
    yield server_factory(api_key=KEY, max_batch=4)
    for adapter in list(served_model.adapters):  # the model is shared with other tests: leave it bare
        served_model.unload_adapter(adapter.name)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _load(server, name, path, key=KEY, **extra) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/adapters", json={"name": name, "path": str(path), **extra},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _answer(client, model, **extra) -> str:
    reply = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=24, **extra)
    assert reply.model == model
    return reply.choices[0].message.content


def test_adapters_load_at_run_time_and_requests_pick_them_by_model_id(keyed, served_model, adapter_paths):
    client = _client(keyed)
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    base = _answer(client, MODEL_ID)
    for name, path in adapter_paths.items():
        loaded = _load(keyed, name, path)
        assert loaded.status_code == 201, loaded.text
        assert loaded.json()["id"] == f"{MODEL_ID}:{name}" and loaded.json()["edgellm"]["rank"] == 16
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {MODEL_ID, f"{MODEL_ID}:polish", f"{MODEL_ID}:translate"}
    polished = _answer(client, f"{MODEL_ID}:polish")
    assert polished == served_model.chat(CHAT, adapter="polish", temperature=0, max_tokens=24).text
    assert polished != base and _answer(client, f"{MODEL_ID}:translate") not in (base, polished)
    by_field = client.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=24,
                                              extra_body={"edgellm": {"adapter": "polish"}})
    assert by_field.choices[0].message.content == polished


def test_adapter_management_needs_the_key_and_bad_adapters_are_typed_errors(server_factory, keyed, adapter_paths,
                                                                             tmp_path):
    open_server = server_factory()
    refused = _load(open_server, "polish", adapter_paths["polish"])
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "api_key_required"
    assert _load(keyed, "polish", adapter_paths["polish"], key="wrong").status_code == 401
    missing = _load(keyed, "x", tmp_path / "nothing")
    assert missing.status_code == 400 and "no LoRA adapter here" in missing.json()["error"]["message"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapter_paths["polish"] / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(
        (adapter_paths["polish"] / "adapter_model.safetensors").read_bytes()[:5000])  # truncated
    truncated = _load(keyed, "broken", broken)
    assert truncated.status_code == 400 and truncated.json()["error"]["code"] == "invalid_adapter"
    with pytest.raises(openai.NotFoundError, match="no adapter 'broken' is loaded"):
        _client(keyed).chat.completions.create(model=f"{MODEL_ID}:broken", messages=CHAT, max_tokens=4)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _client(keyed).chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=4)
    gone = httpx.delete(f"{keyed.url}/v1/adapters/never", headers={"Authorization": f"Bearer {KEY}"})
    assert gone.status_code == 404


def test_unloading_an_adapter_lets_its_running_request_finish_under_it(keyed, served_model, adapter_paths):
    assert _load(keyed, "polish", adapter_paths["polish"]).status_code == 201
    expected = served_model.chat(CHAT, adapter="polish", temperature=0, max_tokens=60)
    assert expected.timings.completion_tokens >= 40  # long enough that the unload lands mid-request
    client, pieces, started = _client(keyed), [], threading.Event()

    def stream() -> None:
        for chunk in client.chat.completions.create(model=f"{MODEL_ID}:polish", messages=CHAT, temperature=0,
                                                    max_tokens=60, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(30)
    deleted = httpx.delete(f"{keyed.url}/v1/adapters/polish", headers={"Authorization": f"Bearer {KEY}"})
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    reader.join(60)
    assert "".join(pieces) == expected.text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=f"{MODEL_ID}:polish", messages=CHAT, max_tokens=4)


def test_requests_under_different_adapters_batch_together_as_each_alone(keyed, served_model, adapter_paths):
    for name, path in adapter_paths.items():
        assert _load(keyed, name, path).status_code == 201
    models = [f"{MODEL_ID}:polish", MODEL_ID, f"{MODEL_ID}:translate", f"{MODEL_ID}:polish"]
    for m in set(models):  # each prompt's prefix cached first, so that alone and together start from it:
        _answer(_client(keyed), m)  # a whole prompt's GEMM (bf16 where native) and a cached one's rows differ
    alone = [_answer(_client(keyed), m) for m in models]
    decoder, widest = served_model.net.decoder, []
    native_step = decoder.step_rows

    def watched(work, *args, **kwargs):  # the real native step, noting how many sequences each call holds
        adapters = kwargs.get("adapters") or (args[1] if len(args) > 1 else [])
        widest.append(len({id(a) for a in adapters}))
        return native_step(work, *args, **kwargs)

    decoder.step_rows = watched
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda m: _answer(_client(keyed), m), models))
    finally:
        del decoder.step_rows
    assert together == alone
    assert max(widest) >= 2  # rows under different adapters share native calls: never a batch per adapter
