"""`edgellm serve` with several models, as a user starts it: a real process, its flags, the official client."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from edgellm.entrypoints.cli.serve import keep_alive, served_models
from edgellm.errors import InvalidRequest


def test_model_flags_name_what_clients_ask_for():
    assert served_models([]) == {"smollm2-135m": "smollm2-135m"}
    assert served_models(["assistant=qwen:v1", "gemma3-270m", "/models/a=b.gguf"]) == {
        "assistant": "qwen:v1", "gemma3-270m": "gemma3-270m", "/models/a=b.gguf": "/models/a=b.gguf"}
    with pytest.raises(InvalidRequest):
        served_models(["a=x", "a=y"])


def test_keep_alive_takes_seconds_minutes_hours_and_never():
    assert keep_alive(None, 1) is None and keep_alive(None, 2) == 300
    assert (keep_alive("45", 2), keep_alive("5m", 2), keep_alive("1h", 1), keep_alive("never", 2)) == (45, 300, 3600, None)
    for bad in ("soon", "-3", "m"):
        with pytest.raises(InvalidRequest):
            keep_alive(bad, 2)


def test_a_server_of_two_models_under_a_budget(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"EDGELLM_HOME": str(tmp_path / "store")}
    server = subprocess.Popen([sys.executable, "-m", "edgellm", "serve", "-m", "small=smollm2-135m", "-m",
                               "gemma=gemma3-270m", "--memory", "1000MB", "--api-key", "k", "--port", str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.time() < deadline, server.stdout.read() if server.poll() else ""
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list()] == ["small", "gemma"]
        reply = client.completions.create(model="gemma", prompt="The three primary colors are", max_tokens=5,
                                          temperature=0)
        assert reply.choices[0].text.strip()
        states = {m["id"]: m["state"] for m in httpx.get(url + "/admin/models", headers={"Authorization": "Bearer k"})
                  .json()["data"]}
        assert states == {"small": "unloaded", "gemma": "loaded"}  # 1000MB holds one of them
        swapped = httpx.post(url + "/admin/models/small/swap", json={"model": "gemma3-270m"},
                             headers={"Authorization": "Bearer k"}, timeout=120)
        assert swapped.status_code == 200, swapped.text  # gemma, idle, made room for small's new version
        states = {m["id"]: (m["state"], m["model"]) for m in httpx.get(
            url + "/admin/models", headers={"Authorization": "Bearer k"}).json()["data"]}
        assert states == {"small": ("loaded", "gemma3-270m"), "gemma": ("unloaded", "gemma3-270m")}
    finally:
        server.terminate()
        server.wait(30)
