"""Activation-aware scaling (AWQ, Lin et al. 2023), searched per block on calibration text.

Input channels that carry large activations matter most, so before quantizing a linear W
we scale its input channels up, W' = W·diag(s), and fold 1/s into whatever produced the
input, so the float model is unchanged:

    s = mean|x|^α / (normalizer),   α ∈ [0, 1] searched to minimize ‖x·(Q(W·s)/s − W)ᵀ‖²

α = 0 (no scaling) is in the grid, so the calibration error never gets worse. Folding:
the pre-attention norm takes 1/s for q/k/v, the pre-MLP norm for gate/up, and up's output
rows for down (silu(gate)·up is linear in up). The attention output projection is left
alone: with grouped-query attention v's rows are shared by several heads."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from edgellm.quant.schemes import Scheme, quantize

GRID = [i / 10 for i in range(11)]
MAX_ROWS = 512  # calibration activations kept per linear


@dataclass(frozen=True)
class ScaleGroup:
    """Linears that share an input, and the tensor whose output rows (or norm weight) feeds it."""

    source: str  # a norm weight (1-D) or a linear whose output rows are scaled down
    targets: tuple[str, ...]
    inputs_of: str  # which captured activation feeds the targets


def block_groups(layer: int) -> list[ScaleGroup]:
    p = f"blk.{layer}"
    return [
        ScaleGroup(f"{p}.attn_norm.weight", (f"{p}.attn_q.weight", f"{p}.attn_k.weight", f"{p}.attn_v.weight"), "qkv"),
        ScaleGroup(f"{p}.ffn_norm.weight", (f"{p}.ffn_gate.weight", f"{p}.ffn_up.weight"), "gate_up"),
        ScaleGroup(f"{p}.ffn_up.weight", (f"{p}.ffn_down.weight",), "down"),
    ]


def capture_inputs(net: torch.nn.Module, run: Callable[[], None]) -> list[dict[str, torch.Tensor]]:
    """Per block, the inputs of its q/k/v, gate/up and down projections while `run()` runs
    the float model over calibration text (at most MAX_ROWS rows each, evenly spaced)."""
    captured: list[dict[str, torch.Tensor]] = [{} for _ in net.blocks]
    hooks = []
    for i, block in enumerate(net.blocks):
        for key, module in (("qkv", block.attn.qkv_proj), ("gate_up", block.mlp.gate_up_proj),
                            ("down", block.mlp.down_proj)):
            def hook(_m, args, _out, i=i, key=key):
                x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
                step = max(1, x.shape[0] // MAX_ROWS)
                captured[i][key] = torch.cat([captured[i].get(key, x[:0]), x[::step][:MAX_ROWS]])[-MAX_ROWS:]
            hooks.append(module.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            run()
    finally:
        for h in hooks:
            h.remove()
    return captured


def search_scale(x: torch.Tensor, weights: list[torch.Tensor], schemes: list[Scheme]) -> tuple[torch.Tensor, float, float]:
    """The best per-channel scale s for linears sharing input x; returns (s, α, error ratio
    vs no scaling)."""
    act = x.abs().mean(dim=0).clamp_min(1e-6)
    reference = [x @ w.T for w in weights]
    best = (torch.ones_like(act), 0.0, None)
    base_err = None
    for alpha in GRID:
        s = act.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        err = sum(float(((x @ (quantize(w * s, sc).dequantize() / s).T) - ref).pow(2).sum())
                  for w, sc, ref in zip(weights, schemes, reference))
        if alpha == 0.0:
            base_err = err
        if best[2] is None or err < best[2]:
            best = (s, alpha, err)
    return best[0], best[1], (best[2] / base_err if base_err else 1.0)


def apply_awq(floats: dict[str, torch.Tensor], captured: list[dict[str, torch.Tensor]],
              scheme_of: Callable[[str], Scheme | None], progress: Callable[[int, int], None] | None = None
              ) -> list[float]:
    """Scale and fold in place, block by block; returns each searched group's error ratio."""
    ratios = []
    for layer, inputs in enumerate(captured):
        for group in block_groups(layer):
            schemes = [scheme_of(t) for t in group.targets]
            if not all(s is not None and s.kind in ("int4", "int8") for s in schemes) or group.inputs_of not in inputs:
                continue  # float weights have nothing to gain
            weights = [floats[t] for t in group.targets]
            s, _alpha, ratio = search_scale(inputs[group.inputs_of], weights, schemes)
            for t in group.targets:
                floats[t] = floats[t] * s
            src = floats[group.source]
            floats[group.source] = src / s if src.dim() == 1 else src / s[:, None]
            ratios.append(ratio)
        if progress is not None:
            progress(layer + 1, len(captured))
    return ratios
