"""The service app in-process over fake engines (no registration, no model): the tokenizer.json
path through chat, streams equal to whole answers, failing closed."""

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx

from runtime.service import create_app
from runtime.synth_tokenizer import train_tokenizer_json
from runtime.tokenizer import load_tokenizer

VOCAB, MAX_SEQ = 512, 64


class CountingEngine:
    """Token 300 + step at every step: deterministic text through any tokenizer."""

    def generate(self, prompt, max_tokens, temperature=0.0, seed=0):
        for i in range(max_tokens):
            yield 300 + i


def _launched(tmp_path: Path, slots: int = 2):
    (tmp_path / "tokenizer.json").write_text(train_tokenizer_json(VOCAB))
    tokenizer, _ = load_tokenizer(tmp_path, VOCAB)
    return SimpleNamespace(engines=[CountingEngine() for _ in range(slots)], tokenizer=tokenizer,
                           config=SimpleNamespace(vocab_size=VOCAB), options=SimpleNamespace(model_dir=tmp_path),
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
