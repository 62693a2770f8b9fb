"""Log-probabilities, several choices and the sampling fields clients send, through the official
openai client against a real server, checked against the model's own logits."""
from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from edgellm.generation.logprobs import log_softmax
from tests.http.conftest import MODEL_ID

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TEXT = "The old lighthouse keeper walked down to the harbour"
CLOSE = 0.05  # the server decodes with the decode GEMVs, model.logits runs the prompt path: not bit-equal


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def reference_rows(model, ids: list[int]) -> np.ndarray:
    return log_softmax(np.asarray(model.logits(ids)))


def test_chat_logprobs_are_the_models_own(server, served_model):
    answer = client(server).chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=8, temperature=0,
                                                    logprobs=True, top_logprobs=3)
    entries = answer.choices[0].logprobs.content
    assert len(entries) == answer.usage.completion_tokens
    ids = served_model.chat_ids(CHAT) + [served_model.tokenizer.encode(e.token, add_special_tokens=False)[0]
                                         for e in entries]
    prompt = len(ids) - len(entries)
    rows = reference_rows(served_model, ids)
    for i, entry in enumerate(entries):
        token = ids[prompt + i]
        assert entry.logprob == pytest.approx(rows[prompt + i - 1, token], abs=CLOSE)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy: the top one
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    assert "".join(e.token for e in entries).startswith(answer.choices[0].message.content[:5])


def test_streamed_logprobs_are_the_same_as_whole(server):
    whole = client(server).chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=8, temperature=0,
                                                   logprobs=True, top_logprobs=2)
    stream = client(server).chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=8, temperature=0,
                                                    logprobs=True, top_logprobs=2, stream=True)
    streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]


def test_echo_scores_the_prompt_as_the_loglikelihood_call_does(server, served_model):
    answer = client(server).completions.create(model=MODEL_ID, prompt=TEXT, max_tokens=0, logprobs=1, echo=True,
                                               temperature=0)
    logprobs = answer.choices[0].logprobs
    ids = served_model.tokenizer.encode(TEXT)
    assert answer.choices[0].text == TEXT and "".join(logprobs.tokens) == TEXT
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    rows = reference_rows(served_model, ids)
    assert logprobs.token_logprobs[1:] == pytest.approx([rows[i - 1, ids[i]] for i in range(1, len(ids))], abs=CLOSE)
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(ids))]
    assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])


def test_token_id_prompts_several_prompts_and_n(server, served_model):
    ids = served_model.tokenizer.encode(TEXT)
    answer = client(server).completions.create(model=MODEL_ID, prompt=[ids, ids[:5]], max_tokens=4, temperature=0)
    assert [c.index for c in answer.choices] == [0, 1]
    alone = served_model.generate(ids, max_tokens=4, temperature=0).text
    assert answer.choices[0].text == alone
    assert answer.usage.prompt_tokens == len(ids) + 5
    seeded = dict(model=MODEL_ID, messages=CHAT, max_tokens=12, temperature=1.0, n=3, seed=7)
    first = client(server).chat.completions.create(**seeded)
    again = client(server).chat.completions.create(**seeded)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]


def test_n_choices_stream_with_their_index(server):
    whole = client(server).chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=6, temperature=1.0,
                                                   seed=3, n=2)
    stream = client(server).chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=6, temperature=1.0,
                                                    seed=3, n=2, stream=True)
    texts, finished = {0: "", 1: ""}, set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]


def test_logit_bias_bans_and_forces_tokens(server, served_model):
    plain = client(server).completions.create(model=MODEL_ID, prompt=TEXT, max_tokens=3, temperature=0)
    first = served_model.tokenizer.encode(plain.choices[0].text, add_special_tokens=False)[0]
    banned = client(server).completions.create(model=MODEL_ID, prompt=TEXT, max_tokens=3, temperature=0,
                                               logit_bias={str(first): -100})
    assert served_model.tokenizer.encode(banned.choices[0].text, add_special_tokens=False)[0] != first
    target = served_model.tokenizer.encode(" zebra", add_special_tokens=False)[0]
    forced = client(server).completions.create(model=MODEL_ID, prompt=TEXT, max_tokens=2, temperature=0,
                                               logit_bias={str(target): 100})
    assert forced.choices[0].text == served_model.tokenizer.decode([target, target])


def test_penalties_match_the_library(server, served_model):
    for penalties in ({"frequency_penalty": 1.5}, {"presence_penalty": 2.0}, {"frequency_penalty": -0.5}):
        answer = client(server).completions.create(model=MODEL_ID, prompt=TEXT, max_tokens=16, temperature=0,
                                                   **penalties)
        assert answer.choices[0].text == served_model.generate(TEXT, max_tokens=16, temperature=0, **penalties).text


@pytest.mark.parametrize("field, value", [("audio", {"voice": "alloy"}), ("modalities", ["audio"]),
                                          ("functions", [{"name": "f"}]), ("store", True),
                                          ("frequency_penalty", 3), ("logit_bias", {"abc": 1}),
                                          ("logit_bias", {"1": 101}), ("top_logprobs", 21)])
def test_fields_it_does_not_do_are_a_400_naming_them(server, field, value):
    answer = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                        json={"model": MODEL_ID, "messages": CHAT, "max_tokens": 2, field: value})
    assert answer.status_code == 400 and field in answer.json()["error"]["message"], answer.text


def test_completions_fields_it_does_not_do(server):
    for field, value in (("suffix", "end"), ("best_of", 2)):
        answer = httpx.post(server.url + "/v1/completions", timeout=60,
                            json={"model": MODEL_ID, "prompt": "hi", "max_tokens": 2, field: value})
        assert answer.status_code == 400 and field in answer.json()["error"]["message"]
    too_big = httpx.post(server.url + "/v1/completions", json={"model": MODEL_ID, "prompt": [10**9], "max_tokens": 1})
    assert too_big.status_code == 400
