"""lm-evaluation-harness's `local-completions` model against the server, on a small multiple-choice
task file: its loglikelihood path (echo + logprobs on /v1/completions, the server's own tokenizer
through /tokenizer_info and /tokenize) gives each choice the score the model's own logits give it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from edgellm.generation.logprobs import log_softmax
from tests.http.conftest import MODEL_ID

lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " Madrid"], "answer": 0},
    {"question": "Water freezes at a temperature of zero degrees", "choices": [" Celsius", " Kelvin"], "answer": 0},
    {"question": "The opposite of hot is", "choices": [" cold", " loud", " tall", " fast"], "answer": 0},
    {"question": "A week has seven", "choices": [" days", " years", " apples"], "answer": 0},
]
TASK = """task: edgellm_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
"""


def direct_scores(model, context: str, choices: list[str]) -> list[float]:
    """Each continuation's summed log-probability from model.logits over context + continuation."""
    scores = []
    for choice in choices:
        ctx = model.tokenizer.encode(context, add_special_tokens=False)
        whole = model.tokenizer.encode(context + choice, add_special_tokens=False)
        rows = log_softmax(np.asarray(model.logits(whole)))
        scores.append(float(sum(rows[i - 1, whole[i]] for i in range(len(ctx), len(whole)))))
    return scores


def test_local_completions_scores_choices_as_the_model_does(server, served_model, tmp_path):
    data = tmp_path / "questions.jsonl"
    data.write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "edgellm_mc.yaml").write_text(TASK.format(data=data))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model="local-completions", tasks=["edgellm_mc"], task_manager=TaskManager(include_path=str(tasks)),
        model_args=f"base_url={server.url}/v1/completions,model={MODEL_ID},num_concurrent=1,max_retries=1",
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    samples = results["samples"]["edgellm_mc"]
    assert len(samples) == len(QUESTIONS)
    for sample in samples:
        doc = sample["doc"]
        theirs = [float(r[0]) for r in sample["filtered_resps"]]
        ours = direct_scores(served_model, doc["question"], doc["choices"])
        assert theirs == pytest.approx(ours, abs=0.05)
        assert int(np.argmax(theirs)) == int(np.argmax(ours))
    assert results["results"]["edgellm_mc"]["acc,none"] >= 0.75
