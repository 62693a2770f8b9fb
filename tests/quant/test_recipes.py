from __future__ import annotations

import pytest

from edgellm.io.hf_names import hf_name
from edgellm.quant.recipes import BUILTIN, Recipe, fit_group
from edgellm.quant.schemes import Scheme


def scheme(recipe: str, name: str, tied: bool = True, arch: str = "llama") -> str | None:
    found = Recipe.parse(recipe).scheme_for(name, hf_name(arch, name), n_layers=30, tied=tied)
    return None if found is None else found.name


def test_first_matching_rule_wins_with_hf_and_gguf_names():
    r = "q_proj,k_proj,v_proj: int8; *: int4-g64"
    assert scheme(r, "blk.3.attn_q.weight") == "int8"
    assert scheme(r, "blk.3.attn_v.weight") == "int8"
    assert scheme(r, "blk.3.ffn_down.weight") == "int4-g64"
    assert scheme("attn_output: bf16; *: int8", "blk.0.attn_output.weight") == "bf16"
    assert scheme("*.mlp.*: int8", "blk.1.ffn_up.weight") == "int8"


def test_embedding_head_and_layer_selectors():
    r = "lm_head: int8; first,last: int8; layers.7: bf16; *: int4-g32"
    assert scheme(r, "token_embd.weight", tied=True) == "int8"  # the tied table is the head
    assert scheme(r, "token_embd.weight", tied=False) == "int4-g32"
    assert scheme(r, "output.weight", tied=False) == "int8"
    assert scheme(r, "blk.0.ffn_up.weight") == "int8"
    assert scheme(r, "blk.29.attn_k.weight") == "int8"
    assert scheme(r, "blk.7.attn_k.weight") == "bf16"
    assert scheme(r, "blk.17.attn_k.weight") == "int4-g32"


def test_unmatched_weights_have_no_scheme():
    assert scheme("q_proj: int8", "blk.0.ffn_up.weight") is None


def test_builtins_parse():
    for name in BUILTIN:
        assert Recipe.parse(name).rules


@pytest.mark.parametrize("bad", ["", "int8 int4", ": int8", "q_proj: int5", "q_proj int8"])
def test_bad_recipes_are_refused(bad):
    with pytest.raises(ValueError):
        Recipe.parse(bad)


def test_group_falls_back_to_what_divides_k():
    assert fit_group(Scheme.parse("int4-g128"), 576).name == "int4-g64"  # SmolLM2's hidden size
    assert fit_group(Scheme.parse("int4-g128-asym"), 1536).name == "int4-g128-asym"
    assert fit_group(Scheme.parse("int4-g32"), 100).name == "int8"
