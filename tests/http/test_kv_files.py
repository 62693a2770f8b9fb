"""A conversation's KV saved and restored: Session.save / Service.restore in the library, and the
/admin/kv routes over HTTP. A restored conversation continues token for token as the original
would have, from the saved KV (prefix hits); another model's file is refused; names cannot leave
the KV folder."""
from __future__ import annotations

import os

import httpx
import openai
import pytest

import edgellm
from edgellm.errors import KVStateMismatch
from edgellm.serving.service import Service
from tests.http.conftest import MODEL_ID, RunningServer

KEY = "s3cret"
FIRST = [{"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "The capital of France is Paris."}]
NEXT = {"role": "user", "content": "And of Italy?"}


def test_a_restored_session_continues_as_the_original(smollm2_path, gemma3_path, tmp_path):
    saved = tmp_path / "talk.kv"
    with edgellm.load(smollm2_path) as model:
        service = Service(model)
        try:
            session = service.init(max_tokens=16, temperature=0)
            list(session.infer(FIRST[0]["content"]))
            assert session.save(saved) > 0
            expected = list(session.infer(NEXT["content"]))[-1]
        finally:
            service.close()
    with edgellm.load(smollm2_path) as fresh:  # another load: nothing cached but the file
        service = Service(fresh)
        try:
            restored = service.restore(saved, max_tokens=16, temperature=0)
            assert restored.messages == session.messages[:2]
            done = list(restored.infer(NEXT["content"]))[-1]
        finally:
            service.close()
    assert done.token_ids == expected.token_ids and done.timings.prefix_hit_tokens > 0
    with edgellm.load(gemma3_path) as other:
        service = Service(other)
        try:
            with pytest.raises(KVStateMismatch):
                service.restore(saved)
        finally:
            service.close()


def test_a_same_sized_model_with_other_weights_is_refused(tmp_path):
    from tests.tiny import random_weights, write_gguf

    one = write_gguf(tmp_path / "a.gguf", "llama", random_weights("llama", seed=1), tokenizer="llama")
    two = write_gguf(tmp_path / "b.gguf", "llama", random_weights("llama", seed=2), tokenizer="llama")
    assert one.stat().st_size == two.stat().st_size
    with edgellm.load(one) as model:
        model.save_prefix(list(range(5, 80)), tmp_path / "p.kv")
    with edgellm.load(two) as model:
        with pytest.raises(KVStateMismatch):
            model.load_prefix(tmp_path / "p.kv")


def admin(server, method: str, path: str, body: dict | None = None, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, server.url + path, json=body, headers=headers, timeout=120)


def test_save_and_restore_over_http(server_factory, smollm2_path, tmp_path):
    kv = tmp_path / "kv"
    first = server_factory(api_key=KEY, kv_dir=kv)
    saved = admin(first, "POST", "/admin/kv/save", {"name": "talk-1", "messages": FIRST})
    assert saved.status_code == 200, saved.text
    assert saved.json()["tokens"] > 0 and (kv / "talk-1.kv").is_file()
    assert admin(first, "GET", "/admin/kv").json()["data"] == [{"name": "talk-1", "bytes": saved.json()["bytes"]}]
    ask = dict(model=MODEL_ID, messages=FIRST + [NEXT], max_tokens=12, temperature=0)
    expected = openai.OpenAI(base_url=first.url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(**ask)
    with edgellm.load(smollm2_path) as fresh:  # another model instance: its prefix cache starts empty
        second = RunningServer(fresh, api_key=KEY, kv_dir=kv)
        try:
            restored = admin(second, "POST", "/admin/kv/restore", {"name": "talk-1"})
            assert restored.status_code == 200 and restored.json()["messages"] == FIRST
            again = openai.OpenAI(base_url=second.url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(**ask)
        finally:
            second.stop()
    assert again.choices[0].message.content == expected.choices[0].message.content
    assert again.model_extra["edgellm"]["prefix_hit_tokens"] >= restored.json()["tokens"] > 0
    assert admin(first, "DELETE", "/admin/kv/talk-1").status_code == 200 and not (kv / "talk-1.kv").exists()


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/b", ".hidden", "x" * 65, "..", "a..b"])
def test_names_cannot_leave_the_kv_folder(server_factory, tmp_path, name):
    kv = tmp_path / "kv"
    server = server_factory(api_key=KEY, kv_dir=kv)
    answer = admin(server, "POST", "/admin/kv/save", {"name": name, "messages": FIRST})
    assert answer.status_code in (400, 404, 422) and answer.status_code != 500
    assert not any(p for p in tmp_path.rglob("*") if p.is_file())


def test_links_in_the_kv_folder_are_not_followed(server_factory, tmp_path):
    kv = tmp_path / "kv"
    kv.mkdir()
    target = tmp_path / "outside.kv"
    target.write_bytes(b"not yours")
    os.symlink(target, kv / "trap.kv")
    server = server_factory(api_key=KEY, kv_dir=kv)
    assert admin(server, "POST", "/admin/kv/save", {"name": "trap", "messages": FIRST}).status_code == 400
    assert admin(server, "POST", "/admin/kv/restore", {"name": "trap"}).status_code == 400
    assert target.read_bytes() == b"not yours"


def test_kv_routes_need_the_key(server_factory, tmp_path):
    open_server = server_factory(kv_dir=tmp_path / "kv")
    assert admin(open_server, "GET", "/admin/kv", key=None).status_code == 403
    keyed = server_factory(api_key=KEY, kv_dir=tmp_path / "kv")
    assert admin(keyed, "GET", "/admin/kv", key="wrong").status_code == 401
    assert admin(keyed, "POST", "/admin/kv/restore", {"name": "missing"}).status_code == 404
