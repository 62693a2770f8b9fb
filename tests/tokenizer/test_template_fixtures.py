"""Chat templates as transformers renders them: every real template llama.cpp ships (Qwen2.5,
Qwen3, Llama 3.1/3.2/3.3, Phi-3.5, Gemma 2, SmolLM3, DeepSeek, Mistral, Granite, ... ~70) on
single-turn, system-prompted and multi-turn conversations, with and without the generation
prompt: byte-identical text, or both refusing the conversation."""
from __future__ import annotations

import pytest

from edgellm.chat_template import ChatTemplate
from edgellm.errors import InvalidRequest, TokenizerError
from edgellm.formats.gguf import open_gguf
from edgellm.tokenizer import Tokenizer
from tests.llama_fixtures import models_dir

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}],
]


def _templates() -> list:
    # The tool-use-only templates need a tool list, which edgellm does not pass yet (issue 16).
    return sorted(p for p in (models_dir() / "templates").glob("*.jinja") if "tool_use" not in p.name)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:  # BOS/EOS text for the templates that write them
    return Tokenizer.from_gguf_metadata(open_gguf(models_dir() / "ggml-vocab-llama-bpe.gguf").metadata)


def test_the_fixture_holds_the_templates_of_the_supported_families():
    names = {p.name for p in _templates()}
    for family in ("Qwen2.5-7B-Instruct", "Qwen3-0.6B", "Llama-3.2-3B-Instruct", "Phi-3.5-mini-instruct",
                   "gemma-2-2b-it", "SmolLM3-3B"):
        assert any(family in n for n in names), family
    assert len(names) >= 60


def test_every_template_renders_as_transformers_does(tokenizer):
    from transformers.utils.chat_template_utils import render_jinja_template

    bos, eos = tokenizer.id_to_token(tokenizer.bos_id), tokenizer.id_to_token(tokenizer.eos_id)
    different = []
    for path in _templates():
        ours = ChatTemplate(path.read_text(), tokenizer)
        for conversation in CONVERSATIONS:
            for generation_prompt in (True, False):
                try:
                    expected = render_jinja_template([conversation], chat_template=path.read_text(), bos_token=bos,
                                                     eos_token=eos, add_generation_prompt=generation_prompt)[0][0]
                except Exception:
                    expected = None  # the template refuses this conversation (e.g. Gemma: no system role)
                try:
                    got = ours.render(conversation, add_generation_prompt=generation_prompt)
                except (InvalidRequest, TokenizerError) as e:
                    got = None if expected is None else repr(e)
                if got != expected:
                    different.append((path.name, len(conversation), generation_prompt))
    assert not different, different

