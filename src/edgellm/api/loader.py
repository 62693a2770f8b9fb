"""`edgellm.load(name) -> Model`: open the file, fit the memory budget (beside a speculative
draft, when there is one), build the model, attach its draft."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from edgellm.extras import ToolsNeeded, has_torch
from edgellm.io import open_model
from edgellm.io.gguf import GGUFFile
from edgellm.kv import KVConfig
from edgellm.memory import collector_paused, return_freed_heap, return_large_frees_to_os, reuse_freed_pages
from edgellm.api.model import Model
from edgellm.store import resolve
from edgellm.threads import configure_threads


@collector_paused()  # the model's ~100k long-lived objects: see memory.py
def load(name_or_path: str | Path = "smollm2-135m", *, mode: str = "fast", threads: int | None = None,
         context_length: int | None = None, kv: KVConfig | None = None,
         memory_budget: int | str | None = None, speculative: str | None = None,
         draft: str | Path | Model | None = None, lora: dict[str, str | Path | tuple] | None = None) -> Model:
    """Load a registered model name, a .gguf file, a Hugging Face folder or an edgellm
    quantized file (`edgellm quantize`).

    mode "fast" keeps 4-bit weights packed and multiplies in bf16; "exact" dequantizes
    everything to fp32 (slow; the reference for parity checks). With memory_budget ("1.5GB"),
    the planner picks the context and KV precision that fit and the KV pool enforces it:
    work that would exceed it raises OutOfMemoryBudget instead of the process being killed.

    speculative ("lookup", "draft", "self"; default off) makes it every generation's default;
    `draft` (a name, path or loaded Model with the same vocabulary) is the draft model.
    `lora`: adapters made resident at once, name -> path or (path, scale); a memory budget
    pays for them first."""
    if mode == "exact" and not has_torch():  # the reference runs on PyTorch: say so before loading anything
        raise ToolsNeeded("torch")
    configure_threads(threads)
    return_large_frees_to_os()
    source = open_model(resolve(name_or_path))
    try:
        draft_kv = None
        if memory_budget is not None:
            memory_budget = _budget_beside_adapters(memory_budget, lora or {}, mode)
            if draft is not None and not isinstance(draft, Model):
                memory_budget, draft_kv = _budget_beside_draft(source, memory_budget, context_length, draft)
            context_length, kv = _fit_budget(source, memory_budget, context_length, kv)
        model = Model(source, mode, context_length, kv, speculative)
        for name, where in (lora or {}).items():  # a budget was planned with them in it
            _load_adapter(model, name, where, charge=memory_budget is None)
        if isinstance(draft, Model):
            model.attach_draft(draft)
        elif draft is not None:
            _attach_loaded_draft(model, load(draft, mode=mode, context_length=model.context_length, kv=draft_kv))
    except BaseException:
        source.close()
        raise
    return_freed_heap()
    reuse_freed_pages()
    return model


def _load_adapter(model: Model, name: str, where, charge: bool) -> None:
    path, scale = (where, 1.0) if isinstance(where, (str, Path)) else where
    model.load_adapter(path, name, scale, charge)


def _budget_beside_adapters(budget, lora: dict, mode: str) -> int:
    """The budget left once the adapters are resident (OutOfMemoryBudget if they take it all)."""
    from edgellm.errors import OutOfMemoryBudget
    from edgellm.lora.adapter import resident_bytes
    from edgellm.api.planner import parse_bytes

    total = parse_bytes(budget)
    adapters = sum(resident_bytes(w if isinstance(w, (str, Path)) else w[0], mode) for w in lora.values())
    if adapters >= total:
        raise OutOfMemoryBudget(adapters, total, "the LoRA adapters")
    return total - adapters


def _fit_budget(source: GGUFFile, budget, context_length: int | None, kv: KVConfig | None) -> tuple[int, KVConfig]:
    from edgellm.errors import OutOfMemoryBudget
    from edgellm.api.planner import plan

    fitted = plan(source, budget, want_context=context_length)
    if not fitted.fits:
        raise OutOfMemoryBudget(fitted.budget_bytes - fitted.kv_budget_bytes, fitted.budget_bytes, "the model")
    base = kv or KVConfig(k_precision=fitted.kv_precision, v_precision=fitted.kv_precision)
    return fitted.context_length, replace(base, budget_bytes=fitted.kv_budget_bytes)


def _budget_beside_draft(source: GGUFFile, budget, context_length: int | None, draft) -> tuple[int, KVConfig]:
    """The target's budget once the draft model is paid for (its weights and its KV for the
    context the target alone would plan), and the draft's KV config; OutOfMemoryBudget if the
    draft alone leaves the target nothing."""
    from edgellm.errors import OutOfMemoryBudget
    from edgellm.api.planner import draft_bytes, parse_bytes, plan

    alone = plan(source, budget, want_context=context_length)
    precision, context = alone.kv_precision or "int4", max(alone.context_length, 1)
    with open_model(resolve(draft)) as draft_source:
        fixed, needed = draft_bytes(draft_source, 0, precision), draft_bytes(draft_source, context, precision)
    left = parse_bytes(budget) - needed
    if left <= 0 or not plan(source, left, want_context=context_length).fits:
        raise OutOfMemoryBudget(needed, max(alone.kv_budget_bytes, 0), "the speculative draft")
    return left, KVConfig(k_precision=precision, v_precision=precision, budget_bytes=max(needed - fixed, 1))


def _attach_loaded_draft(model: Model, draft: Model) -> None:
    try:
        model.attach_draft(draft, owned=True)
    except BaseException:
        draft.close()  # a draft that cannot draft for this model is not kept open
        raise
