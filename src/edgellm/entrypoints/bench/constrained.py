"""`edgellm bench --constrained`: decode speed under a JSON-schema constraint against the same
prompts unconstrained, in one process taking turns; the grammar's costs beside it (the
tokenizer table built once per model, each schema's compile, the mask per token)."""
from __future__ import annotations

import statistics
import time
from typing import Callable

SCHEMAS = {
    "contact": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130}}, "required": ["name", "city", "age"]},
    "ticket": {"type": "object", "properties": {
        "intent": {"enum": ["billing", "bug", "feature", "other"]}, "urgent": {"type": "boolean"},
        "summary": {"type": "string", "maxLength": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5}},
        "required": ["intent", "urgent", "summary", "tags"]},
}
PROMPTS = [("contact", "Ada is 36 years old and lives in London. Extract the contact."),
           ("contact", "Contact card: Bob, 51, from Paris."),
           ("ticket", "Turn this into a support ticket: the app crashes when I open settings, please fix it fast!"),
           ("ticket", "Turn this into a support ticket: I was charged twice for my subscription this month.")]


def constrained_report(models: list[str], gen_tokens: int = 128, repeat: int = 3,
                       progress: Callable[[str], None] = lambda line: None) -> dict:
    return {"gen_tokens": gen_tokens, "repeat": repeat,
            "models": {name: _model_report(name, gen_tokens, repeat, progress) for name in models}}


def _model_report(name: str, gen_tokens: int, repeat: int, progress) -> dict:
    import edgellm
    from edgellm.generation.constrain import GrammarState, grammar_tokenizer, json_schema

    with edgellm.load(name) as model:
        started = time.perf_counter()
        grammar_tokenizer(model.tokenizer)
        table_s = time.perf_counter() - started
        compile_ms = {}
        for key, schema in SCHEMAS.items():
            started = time.perf_counter()
            GrammarState(json_schema(schema), model.tokenizer)
            compile_ms[key] = (time.perf_counter() - started) * 1000
        runs = [{"plain": [], "constrained": [], "mask_ms_per_token": [], "valid": []} for _ in PROMPTS]
        for _ in range(repeat):
            for (key, prompt), run in zip(PROMPTS, runs):
                constraint = json_schema(SCHEMAS[key])
                # the same prompt both ways: the note a constrained chat adds, given to the plain one too
                messages = [{"role": "system", "content": constraint.instructions}, {"role": "user", "content": prompt}]
                plain = model.chat(messages, max_tokens=gen_tokens)
                done = model.chat([messages[1]], constraint=constraint, max_tokens=gen_tokens)
                run["plain"].append(plain.timings.decode_tokens_per_s)
                run["constrained"].append(done.timings.decode_tokens_per_s)
                run["mask_ms_per_token"].append(1000 * done.timings.mask_s / max(done.timings.completion_tokens, 1))
                run["valid"].append(bool(done.constraint_met))
                progress(f"{name} {key}: plain {plain.timings.decode_tokens_per_s:.1f} tok/s, constrained "
                         f"{done.timings.decode_tokens_per_s:.1f} tok/s, mask {run['mask_ms_per_token'][-1]:.3f} ms/token")
    prompts = [{"schema": key, "plain_decode_tokens_per_s": statistics.median(r["plain"]),
                "constrained_decode_tokens_per_s": statistics.median(r["constrained"]),
                "mask_ms_per_token": statistics.median(r["mask_ms_per_token"]), "valid": all(r["valid"])}
               for (key, _), r in zip(PROMPTS, runs)]
    for p in prompts:
        p["ratio"] = p["constrained_decode_tokens_per_s"] / p["plain_decode_tokens_per_s"]
    return {"vocab_size": model.tokenizer.vocab_size, "tokenizer_table_s": table_s, "compile_ms": compile_ms,
            "ratio": statistics.geometric_mean([p["ratio"] for p in prompts]),
            "mask_ms_per_token": statistics.median([p["mask_ms_per_token"] for p in prompts]),
            "all_valid": all(p["valid"] for p in prompts), "prompts": prompts}


def format_constrained(report: dict) -> str:
    lines = [f"constrained decoding (JSON schema) against plain, {report['gen_tokens']} tokens at most, greedy, "
             f"medians of {report['repeat']} rounds",
             f"{'model':<16} {'schema':<8} {'plain tok/s':>12} {'constrained':>12} {'ratio':>6} {'mask ms/tok':>12}"]
    for name, m in report["models"].items():
        for p in m["prompts"]:
            lines.append(f"{name:<16} {p['schema']:<8} {p['plain_decode_tokens_per_s']:>12.1f} "
                         f"{p['constrained_decode_tokens_per_s']:>12.1f} {p['ratio']:>5.2f}x {p['mask_ms_per_token']:>12.3f}")
        compiled = ", ".join(f"{k} {v:.1f} ms" for k, v in m["compile_ms"].items())
        lines.append(f"{name:<16} {'all':<8} {'':>12} {'':>12} {m['ratio']:>5.2f}x {m['mask_ms_per_token']:>12.3f}  "
                     f"(vocabulary {m['vocab_size']}: token table {m['tokenizer_table_s']:.2f} s once; compile "
                     f"{compiled}; all valid: {'yes' if m['all_valid'] else 'NO'})")
    return "\n".join(lines)
