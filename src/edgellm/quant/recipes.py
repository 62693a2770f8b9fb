"""Recipes: which scheme each weight gets, as rules over tensor names.

    "q_proj,k_proj,v_proj: int8; *: int4-g64"

Rules are tried in order; the first whose pattern matches wins. A pattern is a shell glob
matched against the weight's names — its GGUF name (`blk.3.attn_q.weight`), its Hugging
Face name (`model.layers.3.self_attn.q_proj.weight`) and the short forms of both
(`attn_q`, `q_proj`). Also understood: `embed` / `lm_head` (the tied table counts as both),
`first` and `last` (every weight of the first / last block), and `layers.N` for block N.
Norms and other vectors are never quantized. A weight whose K does not divide the group
falls back to the largest group that divides it (reported), else to int8."""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from edgellm.quant.builtin_recipes import BUILTIN
from edgellm.quant.schemes import GROUPS, Scheme


@dataclass(frozen=True)
class Rule:
    patterns: tuple[str, ...]
    scheme: Scheme


@dataclass(frozen=True)
class Recipe:
    text: str
    rules: tuple[Rule, ...]

    @classmethod
    def parse(cls, text: str) -> Recipe:
        """A built-in name or rules 'pattern[,pattern]: scheme; ...'."""
        source = BUILTIN.get(text.strip(), text)
        rules = []
        for clause in filter(None, (c.strip() for c in source.split(";"))):
            patterns, sep, scheme = clause.rpartition(":")
            if not sep or not patterns.strip():
                raise ValueError(f"recipe rule {clause!r} is not 'pattern[,pattern]: scheme'")
            rules.append(Rule(tuple(p.strip() for p in patterns.split(",") if p.strip()), Scheme.parse(scheme)))
        if not rules:
            raise ValueError(f"recipe {text!r} has no rules")
        return cls(text.strip(), tuple(rules))

    def scheme_for(self, name: str, hf_name: str | None, n_layers: int, tied: bool) -> Scheme | None:
        """The scheme for a GGUF-named weight (`hf_name`: its Hugging Face name, which rules may use
        too); None when no rule matches (kept as stored)."""
        names = _aliases(name, hf_name, n_layers, tied)
        for rule in self.rules:
            if any(fnmatch.fnmatchcase(n, p) for p in rule.patterns for n in names):
                return rule.scheme
        return None


def _aliases(name: str, hf_name: str | None, n_layers: int, tied: bool) -> set[str]:
    hf = hf_name or name
    names = {name, hf, name.removesuffix(".weight"), hf.removesuffix(".weight")}
    names |= {n.split(".")[-2] for n in (name, hf) if n.count(".") >= 1}  # attn_q, q_proj, ...
    m = re.match(r"blk\.(\d+)\.", name)
    if m:
        layer = int(m.group(1))
        names.add(f"layers.{layer}")
        if layer == 0:
            names.add("first")
        if layer == n_layers - 1:
            names.add("last")
    if name == "token_embd.weight":
        names |= {"embed", "embed_tokens"} | ({"lm_head", "output"} if tied else set())
    if name == "output.weight":
        names |= {"lm_head"}
    return names


def fit_group(scheme: Scheme, k: int) -> Scheme:
    """The scheme itself if K divides its group; else the largest group that divides K; else int8."""
    if scheme.kind != "int4" or k % scheme.group == 0:
        return scheme
    for group in sorted(GROUPS, reverse=True):
        if group < scheme.group and k % group == 0:
            return scheme.with_group(group)
    return Scheme("int8")
