"""The core runtime where PyTorch cannot be imported: the commands people run, the server under the
official openai client, seeded sampling, prefix persistence. Each runs in a subprocess whose
`sitecustomize` makes `import torch` (and the tools extra's rich, safetensors and tokenizers) fail, as on a
device that has only the core install. Nothing here is timed."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from edgellm.extras import TOOLS_MODULES

CORE_ONLY = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in TOOLS_MODULES)
LONG_PROMPT = "The history of the city of Rome is long and full of turns. " * 24  # > any native_prompt_tokens

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def core_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a process in which the tools extra's modules cannot be imported."""
    site = tmp_path_factory.mktemp("core_only")
    (site / "sitecustomize.py").write_text(CORE_ONLY)
    return os.environ | {"PYTHONPATH": str(site), "EDGELLM_PACK_CACHE": "1"}


def edgellm(env: dict[str, str] | None, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgellm", *args], env=env, input=stdin, capture_output=True,
                          text=True, timeout=300)


def python(env: dict[str, str], code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_the_environment_has_no_torch(core_env):
    done = python(core_env, "import torch")
    assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_run_gives_the_text_it_gives_with_torch(core_env, model):
    """A short prompt goes through the native layers either way: the same greedy text, token for token."""
    args = ["run", "What is the capital of France?", "-m", model, "-n", "24"]
    without, with_torch = edgellm(core_env, *args), edgellm(None, *args)
    assert without.returncode == 0, without.stderr
    assert without.stdout == with_torch.stdout and without.stdout.strip()


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_a_long_prompt_goes_in_through_the_native_layers(core_env, model):
    done = edgellm(core_env, "run", "--raw", LONG_PROMPT, "-m", model, "-n", "12")
    assert done.returncode == 0, done.stderr
    assert "Rome" in done.stdout and "12 generated" in done.stderr


def test_seeded_sampling_repeats_and_matches_the_torch_process(core_env):
    args = ["run", "Once upon a time", "--raw", "-t", "0.8", "--top-p", "0.95", "--seed", "7", "-n", "16"]
    first, again, with_torch = edgellm(core_env, *args), edgellm(core_env, *args), edgellm(None, *args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == again.stdout == with_torch.stdout


def test_tasks_info_plan_and_chat(core_env, tmp_path):
    schema = tmp_path / "form.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                                  "required": ["name", "age"]}))
    assert edgellm(core_env, "classify", "--labels", "billing,bug,other", "The app crashes on start").stdout.strip() \
        in ("billing", "bug", "other")
    extracted = json.loads(edgellm(core_env, "extract", "--schema", str(schema), "Bob is 51 and lives in Paris.").stdout)
    assert set(extracted) == {"name", "age"} and isinstance(extracted["age"], int)
    info = edgellm(core_env, "info", "gemma3-270m")
    assert info.returncode == 0 and "gemma3" in info.stdout
    assert edgellm(core_env, "plan", "--memory", "600MB").returncode == 0
    chat = edgellm(core_env, "chat", "-n", "12", stdin="Hi!\n/exit\n")
    assert chat.returncode == 0, chat.stderr


def test_speculative_lookup_and_self_and_int8_kv(core_env):
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog"
    plain = edgellm(core_env, "run", prompt, "-n", "24", "--kv-precision", "int8")
    lookup = edgellm(core_env, "run", prompt, "-n", "24", "--kv-precision", "int8", "--speculative", "lookup")
    assert plain.returncode == 0 and lookup.returncode == 0, lookup.stderr
    assert lookup.stdout == plain.stdout and "lookup:" in lookup.stderr
    self_draft = edgellm(core_env, "run", prompt, "-n", "24", "--kv-precision", "int8", "--speculative", "self")
    assert self_draft.returncode == 0, self_draft.stderr
    assert self_draft.stdout == plain.stdout  # measured, then speculating or not: the same text either way


def test_a_saved_prefix_loads_back_without_torch(core_env, tmp_path):
    code = f"""
import edgellm
path, prompt = {str(tmp_path / "prefix.kv")!r}, {LONG_PROMPT!r}
with edgellm.load("smollm2-135m") as model:
    first = model.generate(prompt, max_tokens=8).text
    print(model.save_prefix(prompt, path))
with edgellm.load("smollm2-135m") as model:
    count = model.load_prefix(path)
    done = model.generate(prompt, max_tokens=8)
    print(count, done.text == first, done.timings.prefix_hit_tokens == count)
"""
    done = python(core_env, code)
    assert done.returncode == 0, done.stderr
    saved, (count, same, reused) = int(done.stdout.split()[0]), done.stdout.split()[1:]
    assert saved > 0 and int(count) == saved and same == "True" and reused == "True"


def says_what_to_install(done: subprocess.CompletedProcess) -> bool:
    """Exit code 7 and, as the last line on stderr, the command that installs the tools extra."""
    last = done.stderr.strip().splitlines()[-1]
    return done.returncode == 7 and "Traceback" not in done.stderr and last.endswith("pip install 'edgellm[tools]'")


def test_exact_mode_and_the_tools_commands_say_what_to_install(core_env, tmp_path):
    assert edgellm(core_env, "--help").returncode == 0
    assert says_what_to_install(edgellm(core_env, "run", "Hi", "--mode", "exact", "-n", "4"))
    (tmp_path / "data.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                                  {"role": "assistant", "content": "Hello"}]}) + "\n")
    assert says_what_to_install(edgellm(core_env, "lora", "train", "--data", str(tmp_path / "data.jsonl"),
                                        "--out", str(tmp_path / "adapter"), "--steps", "1"))


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, smollm2_path) -> Path:
    """A PEFT folder of random rank-8 pairs for SmolLM2 (std 0.05: strong enough to change its text)."""
    import edgellm as api
    from edgellm.lora.peft_io import random_adapter

    folder = tmp_path_factory.mktemp("adapter") / "polish"
    with api.load(smollm2_path) as model:
        random_adapter(folder, model.config, rank=8, seed=1, std=0.05)
    return folder


@pytest.fixture(scope="module")
def core_server(core_env, adapter):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "edgellm", "serve", "--port", str(port), "--speculative", "lookup",
                               "--lora", f"polish={adapter}"],
                              env=core_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                server.kill()
                pytest.fail(f"the server did not start: {server.stderr.read()}")
            time.sleep(0.2)
    yield openai.OpenAI(base_url=url, api_key="none")
    server.terminate()
    server.wait(timeout=30)


def test_the_server_answers_plain_streamed_json_and_tool_calls(core_server):
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    plain = core_server.chat.completions.create(model="smollm2-135m", messages=ask, max_tokens=16, temperature=0)
    assert "Paris" in plain.choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in core_server.chat.completions.create(
        model="smollm2-135m", messages=ask, max_tokens=16, temperature=0, stream=True) if chunk.choices)
    assert streamed == plain.choices[0].message.content
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    shaped = core_server.chat.completions.create(
        model="smollm2-135m", messages=ask, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert set(json.loads(shaped.choices[0].message.content)) == {"city"}
    called = core_server.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "What's the weather in Paris?"}], tools=[WEATHER],
        tool_choice="required", max_tokens=120, temperature=0)
    calls = called.choices[0].message.tool_calls
    assert called.choices[0].finish_reason == "tool_calls" and calls
    assert all(c.function.name == "get_weather" and "city" in json.loads(c.function.arguments) for c in calls)
    story = [{"role": "user", "content": "Write one sentence about the sea."}]
    answers = [core_server.chat.completions.create(model=model, messages=story, max_tokens=24, temperature=0)
               for model in ("smollm2-135m", "smollm2-135m:polish")]
    assert answers[0].choices[0].message.content != answers[1].choices[0].message.content


def test_an_adapter_gives_the_text_it_gives_with_torch(core_env, adapter):
    args = ["run", "The capital of France is", "--raw", "--lora", f"polish={adapter}", "-n", "16"]
    without, with_torch, base = edgellm(core_env, *args), edgellm(None, *args), edgellm(core_env, *args[:3], "-n", "16")
    assert without.returncode == 0, without.stderr
    assert without.stdout == with_torch.stdout != base.stdout


def test_the_store_commands_run_without_torch(core_env, smollm2_path, tmp_path):
    """pull (a local file), list, show, verify, a run by store name, rm: all in the core install."""
    env = core_env | {"EDGELLM_HOME": str(tmp_path / "store")}
    pulled = edgellm(env, "pull", str(smollm2_path), "--name", "mine:v1", "-q")
    assert pulled.returncode == 0 and "mine:v1" in pulled.stdout, pulled.stderr
    assert "mine:v1" in edgellm(env, "list").stdout
    assert json.loads(edgellm(env, "show", "mine:v1", "--json").stdout)["family"] == "llama"
    assert edgellm(env, "verify").returncode == 0
    ran = edgellm(env, "run", "What is the capital of France?", "-m", "mine:v1", "-n", "8")
    assert ran.returncode == 0 and "Paris" in ran.stdout, ran.stderr
    assert edgellm(env, "rm", "mine:v1").returncode == 0
