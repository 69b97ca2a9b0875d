"""lm-evaluation-harness's `local-completions` model over a local multiple-choice task, run in a
process of its own (offline: the task's data is a local JSON file, the tokenizer the checkpoint's
directory). Prints one JSON object: per (run name) every loglikelihood request's context and
continuation ids, as lm-eval encoded them, with the loglikelihood and greediness it computed.

usage: python lm_eval_client.py URL MODEL_ID CHECKPOINT_DIR TASK_DIR MAX_LENGTH
"""

from __future__ import annotations

import json
import sys


def main(url: str, model_id: str, checkpoint: str, task_dir: str, max_length: str) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    # lm-eval's own batching (a list of token-id lists per request) and its concurrency
    runs = {"batch 1": (1, 1), "batch 1 again": (1, 1), "batch 4": (4, 1), "4 concurrent": (1, 4)}
    out = {}
    tasks = TaskManager(include_path=task_dir)
    for name, (batch_size, concurrent) in runs.items():
        lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=model_id, tokenizer=checkpoint,
                                 tokenizer_backend="huggingface", batch_size=batch_size, num_concurrent=concurrent,
                                 max_length=int(max_length), max_retries=1)
        result = simple_evaluate(model=lm, tasks=["dsv4_tiny_choice"], task_manager=tasks, log_samples=True,
                                 bootstrap_iters=0)
        rows = []
        for sample in result["samples"]["dsv4_tiny_choice"]:
            for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
                ctx, cont = lm._encode_pair(context, continuation)
                rows.append({"context": ctx, "continuation": cont, "ll": resp[0][0], "greedy": resp[0][1]})
        out[name] = {"rows": rows, "acc": result["results"]["dsv4_tiny_choice"]["acc,none"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
