"""The command line, run as a user runs it: a real subprocess, real models, exit codes."""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys

import pytest


def edgellm(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgellm", *args], capture_output=True, text=True,
                          input=input, timeout=300)


def test_run_streams_a_reply_with_statistics(smollm2_path):
    result = edgellm("run", "What is the capital of France?", "--model", str(smollm2_path), "-n", "16")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "decode" in result.stderr and "tok/s" in result.stderr


REPEATING = ("edgellm loads a small quantized model, fits it into the memory it is given and serves it through "
             "an OpenAI-compatible local API. Install it with `make install` and run the tests with `make test`. " * 3
             + "\n\nRepeat the text above word for word.")


def test_run_speculates_with_the_same_tokens_and_says_how_it_went(smollm2_path):
    plain = edgellm("run", REPEATING, "--json", "-n", "40", "--model", str(smollm2_path))
    spec = edgellm("run", REPEATING, "--json", "-n", "40", "--model", str(smollm2_path), "--speculative", "lookup")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    plain_out, spec_out = json.loads(plain.stdout), json.loads(spec.stdout)
    assert spec_out["token_ids"] == plain_out["token_ids"]
    assert spec_out["timings"]["speculative"] == "lookup" and spec_out["timings"]["drafted_tokens"] > 0
    stats = edgellm("run", REPEATING, "-n", "40", "--model", str(smollm2_path), "--speculative", "lookup")
    assert re.search(r"lookup: \d+/\d+ guesses kept, [\d.]+ tokens per pass", stats.stderr), stats.stderr


def test_speculative_flags_that_cannot_work_fail_with_their_exit_codes(smollm2_path, gemma3_path):
    no_draft = edgellm("run", "Hi", "-n", "2", "--model", str(smollm2_path), "--speculative", "draft")
    assert no_draft.returncode == 2 and "needs a draft model" in no_draft.stderr
    other_vocabulary = edgellm("run", "Hi", "-n", "2", "--model", str(smollm2_path), "--speculative", "draft",
                               "--draft", str(gemma3_path))
    assert other_vocabulary.returncode == 5 and "does not share the vocabulary" in other_vocabulary.stderr


def test_run_json_output(smollm2_path):
    result = edgellm("run", "Count: 1, 2, 3,", "--raw", "--json", "-n", "6", "--model", str(smollm2_path))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 6
    assert out["timings"]["decode_tokens_per_s"] > 0


def test_chat_keeps_the_conversation(smollm2_path):
    turns = "My name is Ada.\nWhat is my name?\n/reset\nWhat is my name?\n/exit\n"
    result = edgellm("chat", "--model", str(smollm2_path), "-n", "24", "--verbose", input=turns)
    assert result.returncode == 0, result.stderr
    stats = [line for line in result.stderr.splitlines() if "prompt tokens" in line]
    prompt, generated = zip(*[map(int, re.findall(r"(\d+) (?:prompt tokens|generated)", s)) for s in stats])
    assert len(stats) == 3
    # the second turn's prompt holds the first question and answer; /reset forgets them
    assert prompt[1] > prompt[0] + generated[0]
    assert prompt[2] < prompt[0] + generated[0]


def test_chat_commands_are_never_prompts(smollm2_path, tmp_path):
    """/help, /stats, /save, /load, /system and an unknown command go to the chat, not the model;
    a conversation saved and loaded again continues as it would have."""
    saved = tmp_path / "talk.kv"
    turns = (f"What is the capital of France?\n/help\n/stats\n/save {saved}\n/reset\n/load {saved}\n"
             "And of Italy?\n/nonsense\n/system Be brief.\n/exit\n")
    result = edgellm("chat", "--model", str(smollm2_path), "-n", "16", input=turns)
    assert result.returncode == 0, result.stderr
    assert "/save FILE" in result.stderr and "decode" in result.stderr  # the help, the stats line
    assert "saved 2 messages" in result.stderr and "loaded 2 messages" in result.stderr and saved.is_file()
    assert "unknown command /nonsense" in result.stderr and "system prompt set" in result.stderr
    straight = edgellm("chat", "--model", str(smollm2_path), "-n", "16",
                       input="What is the capital of France?\nAnd of Italy?\n/exit\n")
    answers = lambda out: [s.strip() for s in out.split("> ") if s.strip()]  # noqa: E731 (stdout: prompts and replies)
    assert answers(result.stdout) == answers(straight.stdout) and len(answers(straight.stdout)) == 2


def test_info_describes_both_models(smollm2_path, gemma3_path):
    out = json.loads(edgellm("info", str(smollm2_path), "--json").stdout)
    assert out["architecture"] == "llama" and out["tensor_types"]["Q4_1"] == 210
    assert out["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2  # f16 KV, the default
    text = edgellm("info", str(gemma3_path)).stdout
    assert "gemma3" in text and "Q4_K" in text and "parameters" in text


@pytest.mark.parametrize("args, code, message", [
    (["run", "hi", "--model", "no-such-model"], 3, "no model named"),
    (["run", "hi", "--temperature", "-1"], 2, "temperature"),
    (["run", "hi", "--top-p", "0"], 2, "top_p"),
    (["info", "/nonexistent/model.gguf"], 3, "no model named"),
    (["run", "hi", "--threads", "0"], 2, "threads"),
])
def test_bad_input_gives_one_line_error_and_exit_code(args, code, message):
    result = edgellm(*args)
    assert result.returncode == code
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert result.stderr.startswith("edgellm: error:") and message in result.stderr


def test_corrupt_model_file_is_refused(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 7)
    result = edgellm("run", "hi", "--model", str(bad))
    assert result.returncode == 4 and "truncated" in result.stderr and str(bad) in result.stderr


def test_bad_flag_is_an_argparse_error():
    result = edgellm("run")
    assert result.returncode == 2 and "usage" in result.stderr


def test_the_command_line_parses_its_arguments_without_torch():
    """`edgellm --help` and a bad flag answer at once: torch (~1 s) is imported by the command that needs it."""
    done = subprocess.run([sys.executable, "-c", "import sys, edgellm.entrypoints.cli\n"
                           "edgellm.entrypoints.cli.build_parser().parse_args(['run', 'hi'])\nprint('torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["False"], done.stderr


def test_serve_threads_follow_the_cores_actually_free(monkeypatch):
    import psutil

    from edgellm import threads

    monkeypatch.setattr(threads, "default_threads", lambda: 4)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 4)
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None, percpu=False: [97.0, 3.0, 99.0, 10.0])
    assert threads.free_cores() == 2  # two of four cores are busy with other work
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None, percpu=False: [100.0] * 4)
    assert threads.free_cores() == 1  # never zero


def test_the_thread_count_is_edgellms_and_torch_follows_it():
    code = ("import sys; from edgellm import threads; n = threads.configure_threads(1); "
            "print(n, threads.current(), 'torch' in sys.modules); "
            "import torch; print(torch.get_num_threads()); "  # told before its import, through OMP_NUM_THREADS
            "threads.configure_threads(2); print(threads.current(), torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1", "False", "1", "2", "2"]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "smollm3", "phi3", "gemma2"])
def test_info_run_quantize_and_eval_work_on_every_architecture(arch, tmp_path):
    import gguf

    from tests.tiny import random_weights, write_gguf

    path = write_gguf(tmp_path / f"{arch}.gguf", arch, random_weights(arch, head_dim=32, layers=4), head_dim=32,
                      layers=4, tokenizer="llama", qtype=gguf.GGMLQuantizationType.Q8_0)
    info = edgellm("info", str(path))
    assert info.returncode == 0 and re.search(rf"architecture\s+{arch}\b", info.stdout), info.stdout + info.stderr
    done = edgellm("run", "hello there", "--model", str(path), "-n", "6", "--ignore-eos", "--json")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["token_ids"]) == 6
    out = tmp_path / f"{arch}.edgellm"  # --no-eval: the quality check's 256-token text needs more context than 256
    quantized = edgellm("quantize", str(path), str(out), "--recipe", "int8", "--no-eval", "-q")
    assert quantized.returncode == 0 and out.is_file(), quantized.stderr
    again = edgellm("run", "hello there", "--model", str(out), "-n", "3", "--ignore-eos", "--json")
    assert again.returncode == 0 and len(json.loads(again.stdout)["token_ids"]) == 3, again.stderr
    text = tmp_path / "short.txt"
    text.write_text("the quick brown fox jumps over the lazy dog again and again")
    scored = edgellm("eval", str(out), "--reference", str(path), "--text", str(text), "--json")
    assert scored.returncode == 0, scored.stderr
    assert json.loads(scored.stdout)["kl_mean"] < 0.01  # INT8 weights: next-token distributions barely move


FROZEN = """
import gc, sys
import edgellm
from edgellm.entrypoints.cli import build_parser
from edgellm.entrypoints.cli.generate import load_model
edgellm.load(sys.argv[1]).close()
library = gc.get_freeze_count()
load_model(build_parser().parse_args(["run", "hi", "--model", sys.argv[1]]))
print(library, gc.get_freeze_count(), len(gc.get_objects()))
"""


def test_a_commands_model_leaves_the_collectors_scans_and_a_librarys_does_not(smollm2_path):
    """edgellm.load leaves its objects to the collector (a caller may drop the model); a command, whose
    process keeps its model, freezes them: no collection scans them again (the first one after a load
    took ~100 ms inside the first request, and the interpreter's last one ~0.2 s at exit)."""
    done = subprocess.run([sys.executable, "-c", FROZEN, str(smollm2_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    library, command, left = map(int, done.stdout.split())
    assert library == 0 and command > 20_000 and left < command / 100


COMMAND_PASSES = """
import gc, sys
from edgellm.entrypoints.cli import main
passes = []
gc.callbacks.append(lambda phase, info: passes.append(info["generation"]) if phase == "start" else None)
code = main(["run", "Hello", "-n", "2", "--model", sys.argv[1]])
print(code, len(passes), gc.isenabled(), file=sys.stderr)
"""


def test_a_command_imports_torch_and_loads_with_the_collector_off_and_runs_with_it_on(smollm2_path):
    """Each collection pass during the command's imports and load walked all the objects made before it
    (~0.25 s of `edgellm run`); after the load the collector is on again, its objects frozen."""
    done = subprocess.run([sys.executable, "-c", COMMAND_PASSES, str(smollm2_path)], capture_output=True, text=True,
                          timeout=300)
    code, passes, enabled = done.stderr.split()[-3:]
    assert (code, enabled) == ("0", "True"), done.stderr
    assert int(passes) < 20  # a few over two tokens; ~200 with the collector on from the start
