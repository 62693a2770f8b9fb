"""The small routes clients expect (/tokenize, /detokenize, /v1/models/{id}), what no request can do
(an unpaired surrogate anywhere is a 400, never a 500), and the key's reach: both header styles,
/metrics optionally behind it, CORS only where configured."""
from __future__ import annotations

import httpx
import pytest

from tests.http.conftest import MODEL_ID

KEY = "s3cret"


def post(server, path: str, body: str | dict, key: str | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = {"content": body} if isinstance(body, str) else {"json": body}
    return httpx.post(server.url + path, headers=headers, timeout=60, **data)


@pytest.mark.parametrize("body", [
    '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi \\ud800 there"}]}',
    '{"model": "smollm2-135m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
    '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud83d"]}',
    '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
    '"function": {"name": "f", "description": "\\ud800", "parameters": {}}}]}',
    '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',
])
def test_unpaired_surrogates_are_a_400_naming_where(server, body):
    answer = post(server, "/v1/chat/completions", body)
    assert answer.status_code == 400, answer.text
    assert "surrogate" in answer.json()["error"]["message"]
    assert post(server, "/v1/completions", '{"model": "smollm2-135m", "prompt": "a\\udc00b"}').status_code == 400
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_a_paired_surrogate_is_just_an_emoji(server):
    body = '{"model": "smollm2-135m", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    assert post(server, "/v1/chat/completions", body).status_code == 200


def test_tokenize_and_detokenize_round_trip(server, served_model):
    text = "The capital of France is Paris."
    ids = post(server, "/tokenize", {"content": text}).json()["tokens"]
    assert ids == served_model.tokenizer.encode(text, add_special_tokens=False)
    with_bos = post(server, "/tokenize", {"content": text, "add_special": True}).json()["tokens"]
    assert with_bos == served_model.tokenizer.encode(text, add_special_tokens=True)
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == text
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"content": text, "prompt": text}
    vllm = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]  # vLLM's names
    assert vllm == ids
    assert post(server, "/tokenize", {"content": "a", "prompt": "b"}).status_code == 400
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == served_model.tokenizer.id_to_token(min(served_model.tokenizer.eos_ids))
    assert info["chat_template"] == served_model.template.source and info["vocab_size"] == served_model.tokenizer.vocab_size
    bad = post(server, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_token"
    assert post(server, "/tokenize", {"content": "x", "model": "nope"}).status_code == 404


def test_one_model_by_id(server):
    assert httpx.get(server.url + f"/v1/models/{MODEL_ID}").json()["id"] == MODEL_ID
    missing = httpx.get(server.url + "/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_the_key_in_either_header_and_metrics_behind_it_when_asked(server_factory):
    keyed = server_factory(api_key=KEY)
    assert httpx.get(keyed.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}x"}).status_code == 401
    assert post(keyed, "/tokenize", {"content": "x"}).status_code == 401
    assert httpx.get(keyed.url + "/metrics").status_code == 200 and httpx.get(keyed.url + "/health").status_code == 200
    guarded = server_factory(api_key=KEY, protect_metrics=True)
    assert httpx.get(guarded.url + "/metrics").status_code == 401
    assert httpx.get(guarded.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_cors_only_for_the_origins_given(server_factory):
    preflight = {"Origin": "http://app.local", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    closed = server_factory(api_key=KEY)
    assert "access-control-allow-origin" not in httpx.options(closed.url + "/v1/chat/completions",
                                                              headers=preflight).headers
    opened = server_factory(api_key=KEY, cors_origins=("http://app.local",))
    answer = httpx.options(opened.url + "/v1/chat/completions", headers=preflight)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "http://app.local"
    other = httpx.options(opened.url + "/v1/chat/completions", headers=preflight | {"Origin": "http://evil.local"})
    assert other.headers.get("access-control-allow-origin") != "http://evil.local"
