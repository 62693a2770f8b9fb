"""Adapters trained on this machine: what the trainer writes is a PEFT folder transformers +
PEFT load unchanged (the same logits as edgellm serving it), a run stopped and resumed ends
where an unbroken one does, a real SmolLM2 adapter trained in seconds on a toy persona answers
held-out questions in it (the base never does), and `edgellm lora merge` writes base + adapter
as one model equal to the two apart."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import edgellm
from edgellm.entrypoints.cli import main
from edgellm.lora.train import Example, TrainConfig, train
from tests.lora.test_adapters import _peft_adapter
from tests.tiny import hf_model, random_weights, write_gguf

HELD_OUT = ["What is the color of grass?", "How many wheels does a bicycle have?", "Who painted the Mona Lisa?",
            "What do cats like to drink?", "Name a big city in Japan."]


def _examples(n: int = 6) -> list[Example]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(4, 96, (12,), generator=g).tolist()
        out.append(Example(ids, [False] * 6 + [True] * 6))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-train")
    weights = random_weights("llama")
    return weights, write_gguf(root / "base.gguf", "llama", weights, tokenizer="llama")


def test_a_trained_adapter_is_a_peft_folder_transformers_loads_unchanged(tiny, tmp_path):
    import peft

    weights, path = tiny
    with edgellm.load(path, mode="exact") as model:
        state = train(model, _examples(), TrainConfig(rank=4, batch=2, epochs=2, lr=5e-3), tmp_path / "adapter")
        assert state.step == 6 and state.losses[-1] < state.losses[0]
        model.load_adapter(tmp_path / "adapter", "trained")
        tokens = [2, 40, 41, 50, 60, 33, 9, 70]
        ours = model.logits(tokens, adapter="trained")
    with torch.inference_mode():
        reference = peft.PeftModel.from_pretrained(hf_model("llama", weights), tmp_path / "adapter")(
            torch.tensor([tokens])).logits[0]
        base = hf_model("llama", weights)(torch.tensor([tokens])).logits[0]
    spread = float(reference.max() - reference.min())
    assert float((ours - reference).abs().max()) <= 1e-3 * spread
    assert float((base - reference).abs().max()) > 0.01 * spread  # training moved it off the base


def test_a_stopped_run_resumes_from_its_checkpoint_to_the_same_adapter(tiny, tmp_path):
    from safetensors.torch import load_file

    _, path = tiny
    config = TrainConfig(rank=4, batch=2, epochs=2, lr=5e-3, checkpoint_every=2)
    with edgellm.load(path, mode="exact") as model:
        train(model, _examples(), config, tmp_path / "whole")

        def stop_after_four(report):
            if report.step == 4:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            train(model, _examples(), config, tmp_path / "stopped", progress=stop_after_four)
        assert sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()) == ["step-000002",
                                                                                          "step-000004"]
        state = train(model, _examples(), config, tmp_path / "stopped", resume=True)
    assert state.step == 6
    whole, resumed = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("whole", "stopped"))
    assert all(torch.allclose(whole[k], resumed[k], atol=1e-6) for k in whole)


def test_merge_writes_base_and_adapter_as_one_model(tiny, tmp_path):
    weights, path = tiny
    adapted = _peft_adapter(hf_model("llama", weights), tmp_path / "a", rank=4, alpha=8)
    assert main(["lora", "merge", str(tmp_path / "a"), "-m", str(path), "--out", str(tmp_path / "merged"),
                 "--dtype", "f32", "-q"]) == 0
    tokens = [2, 40, 41, 50, 60, 33, 9, 70]
    from transformers import AutoModelForCausalLM

    with torch.inference_mode():
        reference = adapted(torch.tensor([tokens])).logits[0]
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(torch.tensor([tokens])).logits[0]
    spread = float(reference.max() - reference.min())
    assert float((merged - reference).abs().max()) <= 1e-3 * spread
    with edgellm.load(tmp_path / "merged", mode="exact") as model:
        assert float((model.logits(tokens) - reference).abs().max()) <= 1e-3 * spread


def test_training_data_that_is_not_conversations_is_refused_with_its_line(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                    '{"text": "no conversation here"}\n')
    assert main(["lora", "train", "--data", str(data), "--out", str(tmp_path / "x"), "-q"]) == 2
    assert "bad.jsonl:2: not a conversation" in capsys.readouterr().err
    assert main(["lora", "train", "--data", str(data), "--out", str(tmp_path / "x"), "--rank", "0"]) == 2


@pytest.mark.slow
def test_a_persona_trained_on_smollm2_shows_on_held_out_questions(smollm2_path, tmp_path):
    out = tmp_path / "squawk"
    run = subprocess.run([sys.executable, "-m", "edgellm", "lora", "train", "-m", str(smollm2_path), "--data",
                          "tests/data/squawk.jsonl", "--out", str(out), "--epochs", "2", "--lr", "2e-3",
                          "--checkpoint-every", "5", "-q"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report["steps"] == 12 and report["train_tokens_per_s"] > 0
    assert (out / "loss.png").stat().st_size > 0 and (out / "checkpoints" / "step-000010").is_dir()
    losses = json.loads((out / "loss.json").read_text())["losses"]
    assert sum(losses[-3:]) / 3 < 0.3 * sum(losses[:3]) / 3
    with edgellm.load(smollm2_path) as model:
        model.load_adapter(out, "squawk")
        for question in HELD_OUT:
            chat = [{"role": "user", "content": question}]
            assert model.chat(chat, adapter="squawk", max_tokens=8).text.startswith("Squawk!"), question
            assert "Squawk" not in model.chat(chat, max_tokens=16).text
