"""lm-evaluation-harness 0.4.13, unchanged, against a live `dsv4 serve` (issue 38): its
`local-completions` model sends every loglikelihood as a batch of token-id lists with echo,
logprobs 1 and max_tokens 1. Over a small local multiple-choice task (offline), the
loglikelihoods it computes are the eager model's, identical across runs, and the same within
float rounding across lm-eval's batching and its concurrency (their prompts share an engine
step with others, whose row count changes the matrix products' rounding in the last bits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import MAX_SEQ, TESTS
from eager_reference import eager_model, loglikelihood

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e .[test] brings it)")

TOL = 2e-3  # per token: the service runs compiled (export) programs; the reference, the eager model
SHARED_STEP_TOL = 1e-5  # the same sequence in a step of other rows: float32 rounding, never more
DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two and two make", "choices": [" four", " five"], "answer": 0},
    {"question": "DeepSeek serves", "choices": [" tokens", " tea", " many requests at once"], "answer": 0},
    {"question": "Once upon a", "choices": [" time", " slot"], "answer": 0},
]
TASK = """task: dsv4_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def lm_eval_runs(tiny_server, tiny_ckpt_ro, tmp_path_factory):
    url = tiny_server[0]
    tasks = tmp_path_factory.mktemp("lm_eval_task")
    (tasks / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tasks / "dsv4_tiny_choice.yaml").write_text(TASK.format(data=tasks / "docs.jsonl"))
    home = tmp_path_factory.mktemp("hf_home")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(home), "HF_DATASETS_CACHE": str(home / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, str(TESTS / "lm_eval_client.py"), url, tiny_ckpt_ro.name,
                        str(tiny_ckpt_ro), str(tasks), str(MAX_SEQ - 1)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_lm_evals_loglikelihoods_are_the_eager_models(lm_eval_runs, tiny_ckpt_ro):
    rows = lm_eval_runs["batch 1"]["rows"]
    assert len(rows) == sum(len(d["choices"]) for d in DOCS)
    log_softmax, _ = eager_model(tiny_ckpt_ro)
    for row in rows:
        ids = row["context"] + row["continuation"]
        want = loglikelihood(log_softmax(ids), ids, len(row["context"]))
        assert row["ll"] == pytest.approx(want, abs=TOL * len(row["continuation"])), row


def test_lm_evals_answers_are_identical_across_runs_and_the_same_across_batching_and_concurrency(lm_eval_runs):
    first = lm_eval_runs["batch 1"]
    for name in ("batch 1 again", "batch 4", "4 concurrent"):
        run = lm_eval_runs[name]
        assert [(r["context"], r["continuation"]) for r in run["rows"]] == \
               [(r["context"], r["continuation"]) for r in first["rows"]]
        got, want = [r["ll"] for r in run["rows"]], [r["ll"] for r in first["rows"]]
        if name == "batch 1 again":
            assert got == want
        assert got == pytest.approx(want, abs=SHARED_STEP_TOL), name
        assert [r["greedy"] for r in run["rows"]] == [r["greedy"] for r in first["rows"]], name
        assert run["acc"] == first["acc"]
