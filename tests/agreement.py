"""How close two models' next-token distributions are, position by position."""
from __future__ import annotations

import torch


def agreement(ours: torch.Tensor, ref: torch.Tensor, rows: int = 32) -> tuple[float, float]:
    """Top-1 agreement and mean KL(ref || ours) over positions (rows of logits). In slices of rows
    that stay in cache: over Gemma's 1,000 x 262k logits, kl_div(reduction="none") on the whole took
    ~11 s, this ~2."""
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    kl = []
    for i in range(0, ours.shape[0], rows):
        log_ours, log_ref = ours[i:i + rows].log_softmax(-1), ref[i:i + rows].log_softmax(-1)
        kl.append((log_ref.exp() * (log_ref - log_ours)).sum(-1))
    return top1, torch.cat(kl).mean().item()
