"""Task presets on constrained generation, for apps that want data rather than prose:
classify (always one of the labels), extract (an object of a JSON schema), summarize (a
bounded summary of a text of any length). Each is a chat prompt, a constraint and sampling
that suits the task."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from edgellm.generation.constrain import json_schema
from edgellm.errors import EdgeLLMError, InvalidRequest

CLASSIFY = "Classify the text into one of these labels: {labels}.{instructions}\n\nText: {text}"
CONTENT_FREE = "N/A"
EXTRACT = "Extract the information from the text as JSON.{instructions}\n\nText: {text}"
SUMMARIZE = "Summarize the following text in at most {words} words. Keep the key facts.\n\n{text}"
# A small model repeats itself in longer free text; a mild penalty keeps summaries moving.
SUMMARY_SAMPLING = dict(temperature=0.0, repetition_penalty=1.1)


class IncompleteOutput(EdgeLLMError):
    """The model did not finish a valid output within max_tokens (or its timeout)."""

    def __init__(self, what: str, text: str, finish_reason: str):
        self.text, self.finish_reason = text, finish_reason
        super().__init__(f"{what} did not finish within the token limit ({finish_reason}); partial output: {text!r}")


def classify(model, text: str, labels: Sequence[str], *, instructions: str = "", adapter=None) -> str:
    """The label (always one of `labels`) that fits `text` best: each label's log-probability
    as the answer, less its log-probability for a content-free text (contextual calibration,
    Zhao et al. 2021). Small models otherwise favour whichever label starts with the likeliest
    token: SmolLM2 and Gemma 3 gave "billing" to all 30 of tests/data/intents.jsonl when
    decoding greedily under a choice constraint (37 %); calibrated scores: 43 % and 70 %.
    `adapter`: a resident LoRA adapter's name (Model.load_adapter) to score under."""
    if isinstance(labels, str) or len(labels) < 2 or not all(isinstance(x, str) and x.strip() for x in labels):
        raise InvalidRequest("classify needs at least two non-empty labels")
    scores = _label_scores(model, text, tuple(labels), instructions, adapter)
    prior = _label_scores(model, CONTENT_FREE, tuple(labels), instructions, adapter)
    return max(zip((s - p for s, p in zip(scores, prior)), labels))[1]


def _label_scores(model, text: str, labels: tuple[str, ...], instructions: str, adapter) -> list[float]:
    prompt = CLASSIFY.format(labels=", ".join(labels), text=text, instructions=_extra(instructions))
    ids = model.template.encode_chat([{"role": "user", "content": prompt}])
    return model.continuation_logprobs(ids, [model.tokenizer.encode(x, add_special_tokens=False) for x in labels],
                                       adapter)


def extract(model, text: str, schema: dict | str | type, *, instructions: str = "", **sampling: Any) -> Any:
    """The object of `schema` (a JSON schema, its text or a pydantic model) the model reads out
    of `text`: a dict, or an instance of the pydantic model."""
    prompt = EXTRACT.format(text=text, instructions=_extra(instructions))
    done = model.chat([{"role": "user", "content": prompt}], constraint=json_schema(schema),
                      **{"max_tokens": 512, **sampling})
    if not done.constraint_met:
        raise IncompleteOutput("the object", done.text, done.finish_reason)
    return done.parsed


def summarize(model, text: str, *, words: int = 80, progress: Callable[[int, int], None] | None = None,
              **sampling: Any) -> str:
    """A summary of at most about `words` words. A text longer than the context is summarized
    in parts, then the parts' summaries together (`progress(done, total)` after each part)."""
    if words < 5:
        raise InvalidRequest(f"a summary needs at least 5 words, got {words}")
    max_tokens = 2 * words + 16  # about 1.3 tokens a word, and room to finish the sentence
    room = model.context_length - max_tokens - 64  # the template's own tokens
    parts = _parts(model, text, room)
    total = len(parts) + 1 if len(parts) > 1 else 1
    if len(parts) > 1:
        summaries = []
        for i, part in enumerate(parts):
            summaries.append(_summary(model, part, words, max_tokens, sampling))
            if progress is not None:
                progress(i + 1, total)
        text = "\n\n".join(summaries)
    summary = _summary(model, text, words, max_tokens, sampling)
    if progress is not None:
        progress(total, total)
    return summary


def _summary(model, text: str, words: int, max_tokens: int, sampling: dict) -> str:
    prompt = SUMMARIZE.format(words=words, text=text)
    done = model.chat([{"role": "user", "content": prompt}], **{"max_tokens": max_tokens, **SUMMARY_SAMPLING,
                                                                 **sampling})
    return done.text.strip()


def _parts(model, text: str, room: int) -> list[str]:
    """`text` in paragraph-aligned parts of at most `room` tokens (a paragraph longer than
    that is cut by tokens)."""
    if room < 64:
        raise InvalidRequest("the context is too short to summarize in")
    tokenizer = model.tokenizer
    parts, current, used = [], [], 0
    for paragraph in [p for p in text.split("\n\n") if p.strip()] or [text]:
        ids = tokenizer.encode(paragraph, add_special_tokens=False)
        cuts = [ids[i:i + room] for i in range(0, len(ids), room)]
        pieces = [(tokenizer.decode(c), len(c)) for c in cuts] if len(cuts) > 1 else [(paragraph, len(ids))]
        for piece, n in pieces:
            if current and used + n > room:
                parts.append("\n\n".join(current))
                current, used = [], 0
            current.append(piece)
            used += n
    return parts + ["\n\n".join(current)] if current else parts


def _extra(instructions: str) -> str:
    return f" {instructions.strip()}" if instructions.strip() else ""
