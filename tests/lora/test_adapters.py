"""LoRA adapters read as people have them: a PEFT folder written by peft itself, and the GGUF
LoRA llama.cpp's own converter makes of it (the same pairs); adapters that do not fit the base
(another model's shapes, a wrong rank, a truncated file, a projection edgellm does not adapt)
are typed errors naming what is wrong."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from edgellm.errors import ModelFormatError
from edgellm.io.gguf import open_gguf
from edgellm.lora.adapter import PROJECTIONS, AdapterMismatch, load_adapter
from edgellm.models.llama import LlamaConfig
from tests.tiny import LAYERS, VOCAB, hf_model, random_weights, write_gguf

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_adapter(model, folder, rank=4, alpha=8, rslora=False, targets=TARGETS, seed=1):
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    adapted = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # peft starts B at zero (a no-op adapter): make it do something
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    adapted.save_pretrained(folder)
    return adapted


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    weights = random_weights("llama")
    hf = hf_model("llama", weights)
    hf.save_pretrained(root / "base-hf")
    path = write_gguf(root / "base.gguf", "llama", weights)
    with open_gguf(path) as source:
        config = LlamaConfig.from_gguf(source.metadata, VOCAB)
    yield root, weights, config


def test_a_peft_folder_reads_as_its_pairs_and_scale(base, tmp_path):
    root, weights, config = base
    adapted = _peft_adapter(hf_model("llama", weights), tmp_path / "a", rank=4, alpha=8)
    adapter = load_adapter(tmp_path / "a", config)
    assert adapter.rank == 4 and adapter.scale == 2.0 and adapter.projections == PROJECTIONS
    assert len(adapter.pairs) == LAYERS * len(PROJECTIONS)
    lora_a = adapted.base_model.model.model.layers[1].self_attn.k_proj.lora_A["default"].weight
    assert torch.equal(torch.from_numpy(adapter.pairs[1, "k"].a), lora_a.detach())
    _peft_adapter(hf_model("llama", weights), tmp_path / "rs", rank=4, alpha=8, rslora=True)
    rs = load_adapter(tmp_path / "rs", config)
    assert rs.scale == pytest.approx(8 / 2)  # rsLoRA: alpha / sqrt(rank)


def test_llama_cpps_gguf_lora_reads_as_the_same_pairs(base, tmp_path):
    from tests.llama_fixtures import lora_converter_script

    root, weights, config = base
    _peft_adapter(hf_model("llama", weights), tmp_path / "a", targets=["q_proj", "k_proj", "down_proj"])
    out = tmp_path / "a.gguf"
    script = lora_converter_script()
    env = {"PYTHONPATH": str(script.parent / "gguf-py"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, str(script), "--base", str(root / "base-hf"), "--outtype", "f32",
                          "--outfile", str(out), str(tmp_path / "a")], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    peft_pairs, gguf = load_adapter(tmp_path / "a", config), load_adapter(out, config)
    assert gguf.scale == peft_pairs.scale and set(gguf.pairs) == set(peft_pairs.pairs)
    for key, pair in peft_pairs.pairs.items():  # q and k come back in Hugging Face's row order
        assert np.allclose(gguf.pairs[key].a, pair.a) and np.allclose(gguf.pairs[key].b, pair.b), key


def test_adapters_that_do_not_fit_are_typed_errors(base, tmp_path):
    root, weights, config = base
    _peft_adapter(hf_model("llama", weights), tmp_path / "a")
    other = random_weights("llama", head_dim=8)  # another model: q/k/v/o of other shapes
    _peft_adapter(hf_model("llama", other, head_dim=8), tmp_path / "other")
    with pytest.raises(AdapterMismatch, match=r"layer 0 k: A \(4, 64\) and B \(16, 4\) do not fit the base's 32 x 64"):
        load_adapter(tmp_path / "other", config)

    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(cfg | {"r": 8}))
    with pytest.raises(AdapterMismatch, match="rank 4 / 4 but the adapter says 8"):
        load_adapter(tmp_path / "a", config)
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(cfg))

    weights_file = tmp_path / "a" / "adapter_model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
    with pytest.raises(ModelFormatError, match="adapter_model.safetensors: header length"):
        load_adapter(tmp_path / "a", config)

    import peft

    embed = peft.get_peft_model(hf_model("llama", weights), peft.LoraConfig(r=2, target_modules=["embed_tokens"]))
    embed.save_pretrained(tmp_path / "embed")
    with pytest.raises(AdapterMismatch, match="targets no projection"):
        load_adapter(tmp_path / "embed", config)
    with pytest.raises(ModelFormatError, match="no LoRA adapter here"):
        load_adapter(tmp_path / "missing", config)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_exact_mode_with_an_adapter_equals_transformers_with_peft(tmp_path, arch):
    import edgellm

    weights = random_weights(arch)
    adapted = _peft_adapter(hf_model(arch, weights), tmp_path / "a", rank=4, alpha=8)
    tokens = [1, 5, 9, 14, 3, 77, 20, 41]
    with torch.inference_mode():
        reference = adapted(torch.tensor([tokens])).logits[0]
        plain = hf_model(arch, weights)(torch.tensor([tokens])).logits[0]
    with edgellm.load(write_gguf(tmp_path / "base.gguf", arch, weights, tokenizer="llama"), mode="exact") as model:
        model.load_adapter(tmp_path / "a", "a")
        ours, base = model.logits(tokens, adapter="a"), model.logits(tokens)
    spread = float(reference.max() - reference.min())
    assert float((ours - reference).abs().max()) <= 1e-3 * spread
    assert float((base - plain).abs().max()) <= 1e-3 * spread  # the base itself is left as it was
    assert float((plain - reference).abs().max()) > 0.05 * spread  # the adapter changes the logits
