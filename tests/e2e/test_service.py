"""The HTTP service over a real socket: a `dsv4 serve` process, its endpoints, its shutdown."""

import json
import signal
import threading
import time

import httpx
import pytest
from conftest import MAX_SEQ, start_server

from runtime.events import parse


@pytest.fixture
def server(tiny_server):
    return tiny_server


def test_serves_on_loopback_after_a_cache_hit_launch(server):
    url, events, _ = server
    assert url.startswith("http://127.0.0.1:")
    ends = {parse(line).phase: parse(line) for line in events.read_text().splitlines() if parse(line).kind == "end"}
    assert ends["programs"].detail["counts"]["MISS"] == 0  # the module's cache was warm
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["slots"] >= 1 and health["max_seq"] == MAX_SEQ


def test_completion_from_token_ids_is_deterministic_and_matches_registration(server):
    url, _, cold = server
    from runtime.launch.registration import validation_prompt

    prompt = validation_prompt(cold.tokenizer)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    a = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    b = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"] == cold.validation_tokens
    assert a["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 8, "total_tokens": len(prompt) + 8}
    assert a["object"] == "text_completion" and a["choices"][0]["finish_reason"] == "length"


def test_text_prompt_through_the_checkpoint_tokenizer(server, tiny_ckpt_ro):
    from runtime.model.tokenizer import load_tokenizer

    url, _, cold = server
    assert httpx.get(f"{url}/health").json()["tokenizer"] == "tokenizer.json"  # registration loads it
    tokenizer = load_tokenizer(tiny_ckpt_ro, cold.config.vocab_size)[0]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "héllo", "max_tokens": 3}, timeout=120)
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == len(tokenizer.encode("héllo"))


def test_streaming_sse(server):
    url, _, _ = server
    with httpx.stream("POST", f"{url}/v1/completions",
                      json={"prompt": [5, 6, 7], "max_tokens": 4, "stream": True, "ignore_eos": True},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert len(tokens) == 4 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True},
                       timeout=120).json()
    assert whole["choices"][0]["token_ids"] == tokens


@pytest.mark.parametrize("body", [
    {"prompt": "x", "max_tokens": 0},
    {"prompt": "x", "max_tokens": "many"},
    {"prompt": "", "max_tokens": 2},
    {"prompt": [], "max_tokens": 2},
    {"prompt": [1, 2, 10_000_000], "max_tokens": 2},
    {"prompt": [-1], "max_tokens": 2},
    {"prompt": [1] * MAX_SEQ, "max_tokens": 2},
    {"prompt": "x", "temperature": -1},
    {"prompt": "x", "stream": "yes"},
    {"max_tokens": 3},
    [1, 2, 3],
    "not an object",
])
def test_bad_requests_are_4xx_json(server, body):
    url, _, _ = server
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_non_json_body_and_unknown_route(server):
    url, _, _ = server
    r = httpx.post(f"{url}/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert httpx.get(f"{url}/v2/nothing").status_code == 404
    assert httpx.get(f"{url}/v1/completions").status_code == 405


def test_concurrent_requests_share_the_slots(server):
    url, _, _ = server
    results = []

    def one(i):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [10 + i, 20], "max_tokens": 2}, timeout=300)
        results.append(r.status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 8


def test_metrics(server):
    url, _, _ = server
    httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, timeout=60)
    text = httpx.get(f"{url}/metrics").text
    assert 'dsv4_registration_phase_seconds{phase="programs"}' in text
    assert 'dsv4_kernel_cache_programs{outcome="HIT"}' in text
    assert 'dsv4_sidecar_verdict{path="REPACK",reason="missing"} 1.0' in text
    assert 'dsv4_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert "dsv4_request_seconds_bucket" in text and 'dsv4_tokens_total{kind="completion"}' in text


def test_sigterm_drains_in_flight_request_and_exits_0(tiny_ckpt_ro, tmp_path):
    proc, url, events = start_server(tiny_ckpt_ro, tmp_path, "--backend", "eager")
    result = {}

    def slow_request():
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 12}, timeout=120)
        result["status"] = r.status_code
        result["tokens"] = len(r.json()["choices"][0]["token_ids"])

    t = threading.Thread(target=slow_request)
    t.start()
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    t.join(timeout=120)
    assert proc.wait(timeout=60) == 0
    assert result == {"status": 200, "tokens": 12}
    assert any(parse(line).message and "stopped" in parse(line).message for line in events.read_text().splitlines())
