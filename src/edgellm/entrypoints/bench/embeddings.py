"""`edgellm bench --embeddings`: vectors a second from Model.embed, for short and long texts (one
fresh sequence each: its prompt through the native layers, then pooling), per model."""
from __future__ import annotations

import statistics
import time
from typing import Callable

SHORT = "The cat sat on the mat."
LONG = ("The lighthouse at the end of the harbour had been automated for thirty years, but the town still "
        "spoke of it as if a keeper lived there. ") * 8


def embeddings_report(models: list[str], repeat: int, threads: int | None, progress: Callable[[str], None]) -> dict:
    from edgellm.api.loader import load

    results = []
    for name in models:
        with load(name, threads=threads) as model:
            row = {"model": name, "dimensions": model.embed([SHORT])[0].shape[1]}
            for label, text, batch in (("short", SHORT, 32), ("long", LONG, 8)):
                progress(f"{name}: {label} texts ...")
                runs = []
                for _ in range(repeat):
                    start = time.perf_counter()
                    _, tokens = model.embed([text] * batch)
                    runs.append(time.perf_counter() - start)
                seconds = statistics.median(runs)
                row[label] = {"tokens_per_text": tokens // batch, "texts_per_s": round(batch / seconds, 1),
                              "tokens_per_s": round(tokens / seconds, 1)}
            results.append(row)
    return {"repeat": repeat, "results": results}


def format_embeddings(report: dict) -> str:
    lines = ["embeddings (one sequence a text, normalized mean pooling):"]
    for r in report["results"]:
        for label in ("short", "long"):
            m = r[label]
            lines.append(f"  {r['model']:<16} {label:<5} {m['tokens_per_text']:4d} tokens  {m['texts_per_s']:8.1f} texts/s"
                         f"  {m['tokens_per_s']:9.1f} tokens/s  ({r['dimensions']} dimensions)")
    return "\n".join(lines)
