"""OpenAI's response shapes for what the engine produced: the choices of a chat or completions
answer (one per prompt and `n`), their stream chunks, usage, edgellm's report, and log-probabilities
in each route's own shape (chat: `content` entries with `top_logprobs`; completions: `tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`, the prompt's own first under `echo`)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from edgellm.entrypoints.http.structured import Structure, chat_message
from edgellm.generation import Completion
from edgellm.generation.logprobs import TokenLogprob
from edgellm.serving.handle import Handle


@dataclass
class Choice:
    """One answer of a request: its index, its handle, the prompt it answers (as given, and its
    text for `echo`)."""
    index: int
    handle: Handle
    prompt: int  # which of the request's prompts
    echo: str | None = None  # the prompt's text, put before the answer's


def token_entry(tokenizer, token: int, logprob: float | None) -> tuple[str, dict]:
    raw = tokenizer.token_bytes(token)
    text = raw.decode("utf-8", errors="replace")
    return text, {"token": text, "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(tokenizer, entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict:
    content = []
    for entry in entries:
        _, item = token_entry(tokenizer, entry.token_id, entry.logprob)
        item["top_logprobs"] = [token_entry(tokenizer, t, lp)[1] for t, lp in entry.top]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, entries: list[TokenLogprob | None], prompt_ids: list[int] | None = None,
                        offset: int = 0) -> dict:
    """The completions route's shape. `prompt_ids`: under echo, the prompt's tokens, scored by
    `entries`' first len(prompt_ids) (the first None)."""
    tokens, logprobs, tops, offsets = [], [], [], []
    ids = list(prompt_ids or []) + [e.token_id for e in entries[len(prompt_ids or []):]]
    for token, entry in zip(ids, entries):
        text, _ = token_entry(tokenizer, token, None)
        tokens.append(text)
        logprobs.append(None if entry is None else entry.logprob)
        tops.append(None if entry is None else {token_entry(tokenizer, t, None)[0]: lp for t, lp in entry.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def usage(choices: list[Choice], dones: list[Completion]) -> dict:
    """Each prompt's tokens counted once (n choices share it), every choice's completion tokens."""
    prompt = {c.prompt: d.timings.prompt_tokens for c, d in zip(choices, dones)}
    completion = sum(d.timings.completion_tokens for d in dones)
    return {"prompt_tokens": sum(prompt.values()), "completion_tokens": completion,
            "total_tokens": sum(prompt.values()) + completion}


def choice_body(kind: str, choice: Choice, done: Completion, asked: Structure, tokenizer) -> dict:
    if kind == "chat.completion":
        message, finish_reason = chat_message(done, asked)
        logprobs = None if done.logprobs is None else chat_logprobs(tokenizer, done.logprobs)
        return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    text = (choice.echo or "") + done.text
    return {"index": choice.index, "text": text, "logprobs": _completion_logprobs(tokenizer, choice, done),
            "finish_reason": done.finish_reason}


def _completion_logprobs(tokenizer, choice: Choice, done: Completion) -> dict | None:
    if done.logprobs is None:
        return None
    scored = list(done.prompt_logprobs or ()) if choice.echo is not None else []
    prompt_ids = [e.token_id if e is not None else None for e in scored]
    if scored:  # the first prompt token is not scored: its id comes from the handle
        prompt_ids[0] = choice.handle.prompt_ids[0]
    return completion_logprobs(tokenizer, scored + list(done.logprobs), prompt_ids or None)


def full_response(rid: str, kind: str, model_id: str, choices: list[Choice], dones: list[Completion],
                  asked: Structure, tokenizer) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model_id,
            "choices": [choice_body(kind, c, d, asked, tokenizer) for c, d in zip(choices, dones)],
            "usage": usage(choices, dones), "edgellm": report(choices[0].handle, dones[0])}


def chunk(rid: str, created: int, model_id: str, index: int, content, finish_reason, chat: bool,
          logprobs: dict | None = None) -> str:
    if chat:
        delta = content if isinstance(content, dict) else ({"content": content} if content is not None else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_id,
                "choices": [choice]}
    else:
        text = content["content"] if isinstance(content, dict) else content or ""  # a StreamedDeltas delta
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        body = {"id": rid, "object": "text_completion", "created": created, "model": model_id, "choices": [choice]}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def report(handle: Handle, done: Completion) -> dict:
    """edgellm's per-request facts, beside OpenAI's fields (clients ignore unknown ones)."""
    plan = handle.plan
    return {"served_by": "local", "degraded": handle.degraded, "queue_wait_s": round(handle.queue_wait_s, 4),
            "kv_precision": plan.kv_precision if plan else None, "fallback_model": bool(plan and plan.fallback_model),
            **({} if done.constraint_met is None else {"constraint_met": done.constraint_met,
                                                        "closed_early": done.closed_early}),
            **done.timings.as_dict()}


def usage_chunk(rid: str, created: int, model_id: str, choices: list[Choice], dones: list[Completion],
                chat: bool) -> str:
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model_id, "choices": [], "usage": usage(choices, dones),
            "edgellm": report(choices[0].handle, dones[0])}
    return f"data: {json.dumps(body)}\n\n"
