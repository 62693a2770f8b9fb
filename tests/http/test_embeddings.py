"""/v1/embeddings through the official client, and Model.embed beneath it: the same text gives the
same vector, paraphrases sit closer than unrelated sentences, the vectors are the model's pooled
final hidden states, and embedding goes on beside a running generation."""
from __future__ import annotations

import threading

import httpx
import numpy as np
import openai
import pytest

from edgellm.errors import InvalidRequest
from tests.http.conftest import MODEL_ID

PAIRS = [("The cat sat on the mat.", "A cat was sitting on the rug."),
         ("Stock markets fell sharply on Monday.", "Shares dropped steeply at the start of the week."),
         ("How do I bake sourdough bread?", "What is a good recipe for sourdough?")]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def vectors(server, inputs, **options) -> np.ndarray:
    answer = client(server).embeddings.create(model=MODEL_ID, input=inputs, **options)
    assert [d.index for d in answer.data] == list(range(len(answer.data)))
    return np.array([d.embedding for d in answer.data])


def test_same_text_same_vector_and_paraphrases_closest(server):
    texts = [t for pair in PAIRS for t in pair]
    v = vectors(server, texts + [texts[0]])
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(v[0], v[-1])
    similarity = v[:-1] @ v[:-1].T
    for i in range(0, len(texts), 2):
        others = [similarity[i, j] for j in range(len(texts)) if j not in (i, i + 1)]
        assert similarity[i, i + 1] > max(others) + 0.05, np.round(similarity, 3)


def test_vectors_are_the_pooled_final_hidden_states(server, served_model):
    text = PAIRS[0][0]
    ids = served_model.tokenizer.encode(text)
    ours = vectors(server, text, encoding_format="float")[0]
    assert np.allclose(vectors(server, [ids])[0], ours, atol=1e-6)  # token ids: the same vector
    states, read = served_model.embed([text], normalize=False)
    assert read == len(ids)
    assert np.allclose(states[0] / np.linalg.norm(states[0]), ours, atol=1e-5)
    short = vectors(server, text, dimensions=32)[0]
    assert short.shape == (32,) and np.allclose(short, ours[:32] / np.linalg.norm(ours[:32]), atol=1e-5)


def test_pooling_from_the_file_and_by_name(served_model):
    text = PAIRS[1][0]
    mean, _ = served_model.embed([text], pooling="mean")
    last, _ = served_model.embed([text], pooling="last")
    assert served_model.pooling == "mean" and np.allclose(served_model.embed([text])[0], mean)
    assert not np.allclose(mean, last)
    with pytest.raises(InvalidRequest):
        served_model.embed([text], pooling="max")


def test_embeddings_run_beside_a_generation(server):
    stream = client(server).chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Count."}],
                                                    max_tokens=120, stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    got = {}
    thread = threading.Thread(target=lambda: got.setdefault("v", vectors(server, PAIRS[0][0])))
    thread.start()
    thread.join(60)
    assert httpx.get(server.url + "/health").json()["busy"]  # the vectors came while the stream still ran
    rest = [c for c in stream]
    assert got["v"].shape == (1, served_vector_size(server)) and first and rest[-1].choices[0].finish_reason == "length"


def served_vector_size(server) -> int:
    return len(client(server).embeddings.create(model=MODEL_ID, input="x").data[0].embedding)


def test_bad_embedding_requests_are_400s(server):
    for body in ({"input": []}, {"input": [""]}, {"input": "x", "dimensions": 100_000}, {"input": [[10**9]]}):
        with pytest.raises(openai.BadRequestError):
            client(server).embeddings.create(model=MODEL_ID, **body)
    with pytest.raises(openai.NotFoundError):
        client(server).embeddings.create(model="nope", input="x")
