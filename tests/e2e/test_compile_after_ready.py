"""No compile after ready, proven on a live service: random traffic (prompt lengths, concurrent
requests, `n`, logprobs, echo, sampling, streaming, chat) through a compiled `dsv4 serve` of tiny,
MTP on and off, with `--compile-after-ready error`: every response is answered and
`dsv4_compiles_after_ready_total` stays at 0 (no sample of it in /metrics, and no line in the
service's events). The detector itself is proven to count a real compile in
tests/runtime/programs/test_after_ready.py."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import MAX_SEQ, start_server

from runtime.contract import COMPILES_AFTER_READY

ROUNDS = 8


def _request(rng: random.Random, vocab: int) -> tuple[str, dict]:
    """One random request: (path, body) within the service's limits at MAX_SEQ."""
    length = rng.randint(1, MAX_SEQ // 2)
    body: dict = {"max_tokens": rng.randint(1, 8), "temperature": rng.choice((0, 0, 0.8)),
                  "seed": rng.randint(0, 1 << 30), "n": rng.choice((1, 1, 2, 3)), "stream": rng.random() < 0.3}
    if rng.random() < 0.25:  # chat: the template around a short message
        body.update(messages=[{"role": "user", "content": "x" * rng.randint(1, 12)}])
        if rng.random() < 0.5:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
        return "/v1/chat/completions", body
    body["prompt"] = [rng.randrange(vocab) for _ in range(length)]
    if rng.random() < 0.5:
        body["logprobs"] = rng.randint(0, 3)
        body["echo"] = not body["stream"] and rng.random() < 0.5
    return "/v1/completions", body


def _send(url: str, path: str, body: dict) -> int:
    with httpx.Client(timeout=300) as client:
        if body.get("stream"):
            with client.stream("POST", url + path, json=body) as r:
                lines = [line for line in r.iter_lines() if line]
                assert r.status_code != 200 or lines[-1] == "data: [DONE]", lines[-3:]
                assert not any('"finish_reason": "error"' in line or '"finish_reason":"error"' in line
                               for line in lines), lines
                return r.status_code
        r = client.post(url + path, json=body)
        if r.status_code == 200:
            assert all(c["finish_reason"] != "error" for c in r.json()["choices"]), r.json()
        return r.status_code


@pytest.mark.slow
@pytest.mark.parametrize("speculative", ["mtp", "off"])
def test_random_traffic_through_a_compiled_service_compiles_nothing_after_ready(
        speculative, cold_export_launch, tiny_ckpt_ro, tmp_path):
    cache_dir, cold, _ = cold_export_launch
    proc, url, events = start_server(tiny_ckpt_ro, tmp_path, "--backend", "export", "--kernel-cache-dir",
                                     str(cache_dir), "--speculative", speculative, "--compile-after-ready", "error",
                                     "--max-slots", "8")
    try:
        rng = random.Random(f"after-ready-{speculative}")
        statuses = []
        with ThreadPoolExecutor(8) as pool:
            for _ in range(ROUNDS):  # a round: 1 to 8 requests at once (batches of every size)
                batch = [_request(rng, cold.config.vocab_size) for _ in range(rng.randint(1, 8))]
                statuses += pool.map(lambda r: _send(url, *r), batch)
        assert statuses == [200] * len(statuses)
        metrics = httpx.get(f"{url}/metrics").text
        assert f"# TYPE {COMPILES_AFTER_READY.name}_total counter" in metrics  # exported, and at 0:
        assert f"{COMPILES_AFTER_READY.name}_total{{" not in metrics  # no program has a count
        assert "after the service turned ready" not in events.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
