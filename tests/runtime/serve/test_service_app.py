"""The service app in-process over fake engines (no registration, no model): the tokenizer.json
path through chat, streams equal to whole answers, failing closed."""

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
from engine_fakes import CountingEngine

from runtime.model.tokenizer import load_tokenizer
from runtime.serve.app import create_app
from runtime.synth.tokenizer import train_tokenizer_json

VOCAB, MAX_SEQ = 512, 64


def _launched(tmp_path: Path, slots: int = 2):
    (tmp_path / "tokenizer.json").write_text(train_tokenizer_json(VOCAB))
    tokenizer, _ = load_tokenizer(tmp_path, VOCAB)
    return SimpleNamespace(engine=CountingEngine(slots=slots, max_seq=MAX_SEQ), tokenizer=tokenizer,
                           config=SimpleNamespace(vocab_size=VOCAB), spec=SimpleNamespace(model=tmp_path),
                           programs=SimpleNamespace(dims=SimpleNamespace(max_seq=MAX_SEQ)), phases={})


def _calls(launched, *requests):
    """Run requests (method, path, json) against a fresh app; their responses."""

    async def main():
        app = create_app(launched)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://svc") as c:
            out = [await c.request(m, p, json=j) for m, p, j in requests]
        app.state.scheduler.close()
        return out

    return asyncio.run(main())


def _sse(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_chat_through_tokenizer_json_streams_what_it_answers_whole(tmp_path):
    launched = _launched(tmp_path)
    body = {"messages": [{"role": "user", "content": "héllo"}], "max_tokens": 6}
    whole, stream, health = _calls(launched, ("POST", "/v1/chat/completions", body),
                                   ("POST", "/v1/chat/completions", {**body, "stream": True}),
                                   ("GET", "/health", None))
    expected = launched.tokenizer.decode(list(range(300, 306)))
    assert whole.json()["choices"][0]["message"]["content"] == expected != ""
    chunks = _sse(stream.text)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert health.json()["tokenizer"] == "tokenizer.json"


def test_a_service_whose_weights_changed_fails_closed_with_the_reason(tmp_path):
    launched = _launched(tmp_path)
    launched.failure = "sidecar changed under the service (size 8388608 -> 0)"
    health, completion = _calls(launched, ("GET", "/health", None),
                                ("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 1}))
    assert health.status_code == 503 and health.json()["reason"] == launched.failure
    assert completion.status_code == 503 and launched.failure in completion.json()["error"]["message"]
    del launched.failure
    (completion,) = _calls(launched, ("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 1}))
    assert completion.status_code == 200


def test_a_generation_that_fails_mid_stream_ends_the_stream_with_an_error_event(tmp_path):
    launched = _launched(tmp_path, slots=1)
    launched.engine = CountingEngine(slots=1, fail_after=2)  # a bug of ours inside a decode step
    stream, whole, metrics = _calls(launched,
                                    ("POST", "/v1/completions", {"prompt": [1], "max_tokens": 8, "stream": True}),
                                    ("POST", "/v1/completions", {"prompt": [1], "max_tokens": 8}),
                                    ("GET", "/metrics", None))
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    events = _sse(stream.text)
    assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == [300, 301]
    assert events[-1]["error"]["type"] == "server_error"  # said, not a silently cut stream
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error"
    assert 'dsv4_generations_total{reason="error"} 2.0' in metrics.text
    assert 'dsv4_requests_total{endpoint="/v1/completions",status="500"} 1.0' in metrics.text


def test_a_running_request_gets_its_503_at_once_when_the_service_fails_while_its_step_hangs(tmp_path):
    """A lost rank can hold a running step in a collective until the process exits: the failure
    answers the running request at once (503 with the reason, what it decoded so far streamed),
    never a connection dropped at exit; a queued one gets its 503 too."""
    launched = _launched(tmp_path, slots=1)
    launched.engine = CountingEngine(slots=1, gated=True)
    listeners = []
    launched.on_failure = listeners.append
    reason = "rank 1 on host-b lost during phase serve"

    async def main():
        app = create_app(launched)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://svc") as c:
            whole = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": [1], "max_tokens": 8}))
            queued = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": [2], "max_tokens": 8}))
            launched.engine.allow(2)  # two steps of the running request, then its third hangs
            while launched.engine.steps < 2:
                await asyncio.sleep(0.01)
            launched.failure = reason
            for listener in listeners:
                listener(reason)
            answers = await asyncio.wait_for(asyncio.gather(whole, queued), 60)  # a hang guard
        launched.engine.allow(100)  # the hung step ends; the engine thread can stop
        app.state.scheduler.close()
        return answers

    whole, queued = asyncio.run(main())
    assert whole.status_code == 503 and reason in whole.json()["error"]["message"]
    assert queued.status_code == 503 and reason in queued.json()["error"]["message"]
