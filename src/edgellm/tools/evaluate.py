"""`edgellm eval MODEL [--reference REF] [--text FILE]`: how much a (quantized) model's
predictions moved, on real text, teacher-forced.

    perplexity    exp(mean NLL of the text's next tokens)
    KL            KL(P_ref ‖ P_model) per position: mean and 99th percentile
    top-1         how often both models rank the same next token first
    bits/weight   stored bits of the 2-D weights over their parameter count

Both models see the same token ids (the model's tokenizer); logits are computed chunk by
chunk, so a 262k-token vocabulary never holds more than one chunk of logits."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

CHUNK = 256


@dataclass(frozen=True)
class QualityReport:
    model: str
    reference: str | None
    tokens: int
    perplexity: float
    reference_perplexity: float | None
    kl_mean: float | None
    kl_p99: float | None
    top1_agreement: float | None
    bits_per_weight: float
    weight_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        return [("model", self.model), ("reference", self.reference or "-"), ("tokens", str(self.tokens)),
                ("perplexity", fmt(self.perplexity, ".3f")),
                ("reference perplexity", fmt(self.reference_perplexity, ".3f")),
                ("KL mean", fmt(self.kl_mean, ".5f")), ("KL p99", fmt(self.kl_p99, ".5f")),
                ("top-1 agreement", fmt(None if self.top1_agreement is None else 100 * self.top1_agreement, ".2f") + " %"),
                ("bits per weight", fmt(self.bits_per_weight, ".2f")),
                ("weight bytes", f"{self.weight_bytes / 2**20:.1f} MiB")]


def heldout_text() -> str:
    return resources.files("edgellm").joinpath("data/heldout.txt").read_text(encoding="utf-8")


def weight_stats(source) -> tuple[int, float]:
    """(bytes, bits per weight) of a source's 2-D weights as stored."""
    total_bytes = total_params = 0
    for info in source.tensors.values():
        if len(info.shape) == 2:
            total_bytes += info.nbytes
            total_params += info.n_elements
    return total_bytes, 8 * total_bytes / max(total_params, 1)


def logit_chunks(model, ids: Sequence[int], chunk: int = CHUNK) -> Iterator[torch.Tensor]:
    """Teacher-forced logits (t, V) fp32, chunk by chunk, over one fresh sequence."""
    seq, _ = model.kv.new_sequence()
    try:
        with torch.inference_mode():
            for start in range(0, len(ids), chunk):
                part = list(ids[start:start + chunk])
                seq.prepare(len(part))
                yield model.net(torch.tensor([part]), seq)[0].float()
    finally:
        seq.release()


def evaluate(model, reference=None, text: str | None = None, max_tokens: int = 1024) -> QualityReport:
    """Score `model` (and compare to `reference`, both edgellm Models) on `text`."""
    ids = model.tokenizer.encode(text if text is not None else heldout_text())[:max_tokens + 1]
    if len(ids) < 2:
        from edgellm.errors import InvalidRequest

        raise InvalidRequest("the evaluation text needs at least two tokens")
    targets = torch.tensor(ids[1:])
    nll, ref_nll, kls, agree, pos = 0.0, 0.0, [], 0, 0
    ref_chunks = logit_chunks(reference, ids[:-1]) if reference is not None else None
    for logits in logit_chunks(model, ids[:-1]):
        t = targets[pos:pos + logits.shape[0]]
        logp = F.log_softmax(logits, dim=-1)
        nll += float(-logp.gather(1, t[:, None]).sum())
        if ref_chunks is not None:
            ref_logp = F.log_softmax(next(ref_chunks)[:, :logp.shape[1]], dim=-1)
            ref_nll += float(-ref_logp.gather(1, t[:, None]).sum())
            kls.append((ref_logp.exp() * (ref_logp - logp)).sum(dim=-1))
            agree += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
        pos += logits.shape[0]
    weight_bytes, bpw = weight_stats(model.source)
    kl = torch.cat(kls) if kls else None
    return QualityReport(
        model=str(model.path), reference=str(reference.path) if reference is not None else None, tokens=pos,
        perplexity=math.exp(nll / pos), reference_perplexity=math.exp(ref_nll / pos) if kl is not None else None,
        kl_mean=float(kl.mean()) if kl is not None else None,
        kl_p99=float(torch.quantile(kl, 0.99)) if kl is not None else None,
        top1_agreement=agree / pos if kl is not None else None, bits_per_weight=bpw, weight_bytes=weight_bytes)
