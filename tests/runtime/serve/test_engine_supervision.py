"""The engine never dies silently (issue 68, item 4), over fake engines in this process: sampling
numbers whose float32 form cannot be computed are a 400 naming the field before they reach the
engine; numbers that are admitted never turn into NaN on the wire; an error in one sequence or
one step fails only its own requests and the engine goes on; an engine thread that dies turns
/health 503 "failed" at once, answers every waiting request, and tells the service (which exits
non-zero)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from door_fakes import Leaks, fake_launched, served
from engine_fakes import CountingEngine

from runtime.engine import sampling

F32_TINY = 2.0 ** -126


def _strict(text: str):
    """JSON as a strict reader takes it: NaN and Infinity are not JSON."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in a JSON answer"))


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    with served(fake_launched(tmp_path_factory.mktemp("sup"))) as s:
        yield s


@pytest.mark.parametrize(("field", "value"), [
    ("top_p", 1e-300), ("top_p", 1e-40), ("top_p", 5e-324), ("repetition_penalty", 1e-300),
    ("repetition_penalty", 1e-39), ("temperature", 1e-300), ("temperature", 5e-324), ("min_p", 1e-45),
    ("presence_penalty", 1e-320), ("frequency_penalty", -1e-310),
])
def test_a_number_that_is_zero_or_subnormal_in_float32_is_a_400_naming_it(svc, field, value):
    r = svc.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "temperature": 1.0, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: ")
    assert "float32" in error["message"]


@pytest.mark.parametrize("body", [
    {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": -float("inf")},
    {"temperature": 1e308}, {"top_p": float("nan")}, {"top_p": float("inf")}, {"top_p": 1e308},
    {"logit_bias": {"5": 1e-40}}, {"logit_bias": {"5": float("nan")}},
])
def test_nan_infinity_and_1e308_are_400s(svc, body):
    r = svc.post("/v1/completions", content=json.dumps({"prompt": [1], "max_tokens": 1, **body}).encode(),
                 headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(body)), r.text


def test_the_smallest_admitted_numbers_generate_and_write_no_nan(svc):
    """At float32's smallest normal values, penalties and top_p still draw a token, and every
    log-probability is a JSON number (-9999.0 at the floor, as OpenAI writes -inf)."""
    leaks = Leaks(svc)
    body = {"prompt": [300, 301, 302], "max_tokens": 4, "temperature": 2.0, "top_p": F32_TINY,
            "repetition_penalty": F32_TINY, "presence_penalty": 2.0, "logprobs": 5, "echo": True}
    whole = svc.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    lps = _strict(whole.text)["choices"][0]["logprobs"]
    assert all(v is None or -9999.0 <= v <= 0 for v in lps["token_logprobs"])
    stream = svc.post("/v1/completions", json={**body, "stream": True})
    for line in stream.text.splitlines():
        if line.startswith("data: {"):
            _strict(line[6:])
    leaks.check()


class ExtremeEngine(CountingEngine):
    """Logits at float32's limits: the chosen token at +max, every other at -max (their
    log-softmax is -inf in float32)."""

    def step(self, batch, prefill=None, logits_rows=None):
        out = super().step(batch, prefill, logits_rows)
        big = torch.finfo(torch.float32).max
        out.logits = torch.where(out.logits > 0, big, -big)
        return out


def test_logprobs_of_logits_at_the_float32_limits_are_floored_never_infinite(tmp_path):
    with served(fake_launched(tmp_path, engine=ExtremeEngine(slots=2))) as svc:
        body = {"prompt": [1, 2], "max_tokens": 3, "logprobs": 3, "temperature": 0.7}
        whole = svc.post("/v1/completions", json=body)
        assert whole.status_code == 200, whole.text
        tops = _strict(whole.text)["choices"][0]["logprobs"]["top_logprobs"]
        assert {v for top in tops for v in top.values()} == {0.0, -9999.0}  # -inf in float32, floored
        chat = svc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                       "logprobs": True, "top_logprobs": 2, "stream": True})
        events = [_strict(line[6:]) for line in chat.text.splitlines() if line.startswith("data: {")]
        assert any(c["choices"] and c["choices"][0].get("logprobs") for c in events)


def test_one_sequence_whose_sampling_raises_fails_alone_and_the_engine_goes_on(tmp_path, monkeypatch):
    """A fault in one sequence's draw (here: its sampler raises for seed 13) ends that request
    with one clear error; the request beside it in the same steps, and the next, are served."""
    real = sampling.Sampler._draw

    def draw(self, logits):
        if self.params.seed == 13:
            raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
        return real(self, logits)

    monkeypatch.setattr(sampling.Sampler, "_draw", draw)
    engine = CountingEngine(slots=2, gated=True)
    with served(fake_launched(tmp_path, engine=engine)) as svc:
        leaks = Leaks(svc)
        out = {}

        def post(name, seed):
            out[name] = svc.post("/v1/completions", json={"prompt": [1], "max_tokens": 5, "temperature": 1.0,
                                                          "seed": seed})

        threads = [threading.Thread(target=post, args=a) for a in (("bad", 13), ("good", 7))]
        for t in threads:
            t.start()
        while svc.health()["running"] < 2:
            time.sleep(0.01)
        engine.allow(1000)
        for t in threads:
            t.join(60)
        assert out["bad"].status_code == 500 and out["bad"].json()["error"]["message"] == \
            "generation failed; the server log has the details"
        assert out["good"].status_code == 200 and len(out["good"].json()["choices"][0]["token_ids"]) == 5
        assert svc.health()["status"] == "ok"
        assert svc.post("/v1/completions", json={"prompt": [2], "max_tokens": 2}).status_code == 200
        leaks.check()


class DyingEngine(CountingEngine):
    """An engine whose third step raises what no step handler contains: the thread dies."""

    def step(self, batch, prefill=None, logits_rows=None):
        if self.steps == 2:
            raise SystemExit("the engine's device went away")
        return super().step(batch, prefill, logits_rows)


def test_an_engine_thread_that_dies_fails_the_service_at_once_and_answers_everyone(tmp_path):
    told = []
    launched = fake_launched(tmp_path, engine=DyingEngine(slots=1))
    real_fail = launched.fail
    launched.fail = lambda reason: (told.append(reason), real_fail(reason))
    with served(launched) as svc:
        running = svc.post("/v1/completions", json={"prompt": [1], "max_tokens": 8})
        health = httpx.get(f"{svc.url}/health", timeout=30)
        later = svc.post("/v1/completions", json={"prompt": [2], "max_tokens": 1})
    assert running.status_code == 503 and "the engine thread died" in running.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert health.json()["reason"].startswith("the engine thread died (SystemExit: the engine's device went away)")
    assert later.status_code == 503
    assert told and told[0].startswith("the engine thread died")  # `dsv4 serve` fails closed on it: exit 1


def test_tokenizing_runs_off_the_event_loop(tmp_path):
    launched = fake_launched(tmp_path)
    threads = []
    encode = launched.tokenizer.encode
    launched.tokenizer.encode = lambda text: (threads.append(threading.current_thread().name), encode(text))[1]
    with served(launched) as svc:
        loop_thread = "served"  # uvicorn's event loop runs in door_fakes' thread of this name
        assert svc.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1}).status_code == 200
        assert svc.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1}).status_code == 200
    assert len(threads) == 3 and loop_thread not in threads


def test_a_huge_prompt_is_refused_before_it_is_tokenized(tmp_path):
    launched = fake_launched(tmp_path)
    calls = []
    encode = launched.tokenizer.encode
    launched.tokenizer.encode = lambda text: (calls.append(len(text)), encode(text))[1]
    text = "hello world " * 340_000  # 4.08 MB: just under the 4 MiB body cap
    with served(launched) as svc:
        r = svc.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
        chat = svc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert f"{len(text)} characters are at least" in r.json()["error"]["message"]
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert calls == []  # refused on its length alone
