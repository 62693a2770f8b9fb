"""The store's commands as a user types them (a real process, a real server on 127.0.0.1)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys


def edgellm(store, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"EDGELLM_HOME": str(store.root)}
    return subprocess.run([sys.executable, "-m", "edgellm", *args], capture_output=True, text=True, timeout=300, env=env)


def test_pull_list_show_run_rm(server, store, tiny_ggufs):
    data = tiny_ggufs[0].read_bytes()
    url = server.add("/tiny.gguf", body=data)
    pulled = edgellm(store, "pull", url, "--name", "tiny:v1")
    assert pulled.returncode == 0, pulled.stderr
    assert "tiny:v1" in pulled.stdout and "100%" in pulled.stderr  # progress, every 10 % off a terminal
    listed = edgellm(store, "list")
    assert listed.returncode == 0
    row = next(line for line in listed.stdout.splitlines() if line.startswith("tiny:v1"))
    assert "llama" in row and hashlib.sha256(data).hexdigest()[:12] in row and "never" in row
    assert any(line.startswith("smollm2-135m:latest") for line in listed.stdout.splitlines())  # built-ins list themselves
    ran = edgellm(store, "run", "hello", "-m", "tiny:v1", "-n", "3", "--ignore-eos", "--json")
    assert ran.returncode == 0 and len(json.loads(ran.stdout)["token_ids"]) == 3, ran.stderr
    shown = json.loads(edgellm(store, "show", "tiny:v1", "--json").stdout)
    assert shown["sha256"] == hashlib.sha256(data).hexdigest() and shown["last_used"] is not None
    assert edgellm(store, "verify").returncode == 0
    removed = edgellm(store, "rm", "tiny:v1")
    assert removed.returncode == 0 and "deleted 1 file" in removed.stdout
    gone = edgellm(store, "run", "hello", "-m", "tiny:v1")
    assert gone.returncode == 3 and "model store" in gone.stderr


def test_refusals_have_their_exit_codes(server, store, tiny_ggufs):
    url = server.add("/tiny.gguf", body=tiny_ggufs[0].read_bytes())
    wrong = edgellm(store, "pull", url, "--sha256", "0" * 64, "-q")
    assert wrong.returncode == 8 and "sha256" in wrong.stderr and "nothing was stored" in wrong.stderr
    assert edgellm(store, "pull", url, "--name", "../evil").returncode == 2
    assert edgellm(store, "pull", "file:///etc/passwd").returncode == 8
    assert edgellm(store, "show", "nothing-here").returncode == 3


def test_verify_fails_on_a_changed_file(server, store, tiny_ggufs):
    assert edgellm(store, "pull", server.add("/t.gguf", body=tiny_ggufs[0].read_bytes()), "-q").returncode == 0
    blob = next(store.blobs.iterdir())
    blob.chmod(0o644)
    blob.write_bytes(blob.read_bytes()[:-1] + b"\x01")
    checked = edgellm(store, "verify")
    assert checked.returncode == 1 and "t:latest" in checked.stdout
