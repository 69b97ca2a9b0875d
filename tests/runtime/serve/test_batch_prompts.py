"""Batch prompts on /v1/completions (issue 38): OpenAI's four prompt forms, choices indexed
prompt × n + k, each prompt answered as it is alone (echo, logprobs, max_tokens 0 and 1, seeds),
usage summed, streamed with indices, an oversized batch a 400; best_of, logit_bias and suffix as
OpenAI defines them; the official `openai` client's batch call; a client leaving cancels every
prompt's job."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from conftest import app_server, launch
from eager_reference import eager_model, loglikelihood

TOL = 2e-3  # the service runs compiled (export) programs; the reference, the eager model
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture
def url(tiny_app):
    return tiny_app[0]


@pytest.fixture
def client(url):
    import openai  # the client, for the tests that use it: collection stays light

    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _ok(url: str, body: dict) -> dict:
    r = _post(url, body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_batch_of_strings_answers_each_prompt_as_alone_and_sums_usage(url):
    prompts = ["DeepSeek", "Once upon a time", "héllo wörld"]
    batch = _ok(url, {"prompt": prompts, "max_tokens": 5, **GREEDY})
    alone = [_ok(url, {"prompt": p, "max_tokens": 5, **GREEDY}) for p in prompts]
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in batch["choices"]] == [a["choices"][0]["token_ids"] for a in alone]
    assert [c["text"] for c in batch["choices"]] == [a["choices"][0]["text"] for a in alone]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(a["usage"][key] for a in alone)


def test_a_batch_of_id_lists_with_n_is_indexed_prompt_times_n_plus_k_with_ns_seeds(url):
    prompts, n, seed = [[3, 17, 250], [5, 6, 7, 8]], 2, 11
    kw = {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    batch = _ok(url, {"prompt": prompts, "n": n, "seed": seed, **kw})
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):  # choice k of prompt i draws with seed + i × n + k
        alone = _ok(url, {"prompt": p, "n": n, "seed": seed + i * n, **kw})
        assert [c["token_ids"] for c in batch["choices"][i * n:(i + 1) * n]] == \
               [c["token_ids"] for c in alone["choices"]]
    assert batch["usage"]["prompt_tokens"] == 7 and batch["usage"]["completion_tokens"] == 4 * 6
    assert len({tuple(c["token_ids"]) for c in batch["choices"]}) > 1  # sampled, not one answer copied


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_per_prompt_are_the_single_answers_and_the_eager_reference(url, tiny_ckpt_ro, max_tokens):
    """lm-eval's loglikelihood request, batched: echo, logprobs 1, max_tokens 0 or 1."""
    prompts = [[3, 17, 250, 9, 41, 8], [100, 7, 7, 300], [12, 13]]
    kw = {"echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0}
    batch = _ok(url, {"prompt": prompts, **kw})["choices"]
    log_softmax, _ = eager_model(tiny_ckpt_ro)
    for p, choice in zip(prompts, batch, strict=True):
        alone = _ok(url, {"prompt": p, **kw})["choices"][0]
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == len(p) + max_tokens and got[0] is None
        assert got[1:] == pytest.approx(alone["logprobs"]["token_logprobs"][1:], abs=1e-5)
        assert choice["token_ids"] == alone["token_ids"] and len(choice["token_ids"]) == max_tokens
        ll = sum(got[1:len(p)])
        assert ll == pytest.approx(loglikelihood(log_softmax(p), p, 1), abs=TOL * len(p))


def test_a_streamed_batch_streams_every_choice_with_its_index(url):
    body = {"prompt": [[5, 6, 7], [9, 10]], "n": 2, "max_tokens": 4, "temperature": 0.9, "seed": 2,
            "ignore_eos": True}
    whole = _ok(url, body)
    streamed: dict[int, list[int]] = {}
    finished, usage = set(), None
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}},
                      timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                streamed.setdefault(c["index"], []).extend(c["token_ids"])
                if c["finish_reason"]:
                    finished.add(c["index"])
    assert streamed == {c["index"]: c["token_ids"] for c in whole["choices"]}
    assert finished == {0, 1, 2, 3} and usage == whole["usage"]


def test_a_batch_larger_than_the_service_holds_is_a_400_naming_the_limit(url):
    slots = httpx.get(f"{url}/health", timeout=30).json()["slots"]
    r = _post(url, {"prompt": [[1, 2]] * (slots + 1), "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert f"({slots} sequences)" in r.json()["error"]["message"]
    r = _post(url, {"prompt": [[1, 2]] * (slots // 4 + 1), "n": 4, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert _post(url, {"prompt": [[1, 2]] * (slots // 4), "n": 4, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": [[1, 2], []]}, "prompt.1"),
    ({"prompt": ["a", ""]}, "prompt.1"),
    ({"prompt": [[1, 2], "a"]}, "prompt"),
    ({"prompt": [[1, -2]]}, "prompt.0"),
    ({"prompt": [[1, 10_000_000]]}, "prompt.0"),
    ({"prompt": [[1]] * 1025}, "prompt"),
    ({"prompt": [[1, 2]], "best_of": 1, "n": 2}, "best_of"),
    ({"prompt": [[1, 2]], "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": [[1, 2]], "best_of": 129}, "best_of"),
    ({"prompt": [[1, 2]], "best_of": 100}, "best_of"),
    ({"prompt": [[1, 2]], "logit_bias": {"1": 101}}, "logit_bias"),
    ({"prompt": [[1, 2]], "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": [[1, 2]], "logit_bias": {"99999": 5}}, "logit_bias"),
    ({"prompt": [[1, 2]], "logit_bias": [1]}, "logit_bias"),
    ({"prompt": [[1, 2]], "suffix": " the end"}, "suffix"),
])
def test_bad_batches_best_of_logit_bias_and_suffix_are_400s_naming_the_field(url, body, param):
    r = _post(url, {"max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}:"), error


def test_best_of_returns_the_n_draws_with_the_highest_cumulative_logprob(url):
    kw = {"prompt": [[4, 5, 6], [40, 41]], "max_tokens": 5, "temperature": 1.2, "seed": 9, "ignore_eos": True}
    drawn = _ok(url, {**kw, "n": 3, "logprobs": 0})["choices"]  # the same seeds: the best_of draws
    best = _ok(url, {**kw, "n": 1, "best_of": 3})
    assert best["usage"]["completion_tokens"] == 2 * 3 * 5  # every draw was generated
    assert [c["index"] for c in best["choices"]] == [0, 1]
    for i, choice in enumerate(best["choices"]):
        mine = drawn[i * 3:(i + 1) * 3]
        top = max(mine, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
        assert choice["token_ids"] == top["token_ids"]
        assert choice["logprobs"] is None  # ranked by logprobs, shown only when asked for
    two = _ok(url, {**kw, "n": 2, "best_of": 3, "logprobs": 0})["choices"]
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in two]
    assert [c["index"] for c in two] == [0, 1, 2, 3] and sums[0] >= sums[1] and sums[2] >= sums[3]


def test_logit_bias_forces_and_bans_tokens_greedy_and_sampled(url):
    base = {"prompt": [[3, 17, 250]], "max_tokens": 4, "ignore_eos": True}
    free = _ok(url, {**base, "temperature": 0})["choices"][0]["token_ids"]
    forced = _ok(url, {**base, "temperature": 0, "logit_bias": {"77": 100}})["choices"][0]["token_ids"]
    assert forced == [77] * 4
    sampled = _ok(url, {**base, "temperature": 1.0, "seed": 3, "logit_bias": {"77": 100}})["choices"][0]
    assert sampled["token_ids"] == [77] * 4
    banned = _ok(url, {**base, "temperature": 0, "logit_bias": {str(free[0]): -100}})["choices"][0]["token_ids"]
    assert banned[0] != free[0]
    with_lp = _ok(url, {**base, "temperature": 0, "logprobs": 1, "logit_bias": {"77": 100}})["choices"][0]
    assert with_lp["logprobs"]["token_logprobs"][0] == pytest.approx(0.0, abs=1e-4)  # of the biased distribution


def test_the_official_client_sends_batches(client, tiny_ckpt_ro):
    r = client.completions.create(model=tiny_ckpt_ro.name, prompt=["DeepSeek", "V4"], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens <= 6
    r = client.completions.create(model=tiny_ckpt_ro.name, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, n=2,
                                  temperature=0, logit_bias={"9": 100}, best_of=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.model_extra["token_ids"] == [9, 9] for c in r.choices)
    import openai

    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=tiny_ckpt_ro.name, prompt="x", suffix="y", max_tokens=1)


def test_chat_refuses_best_of_and_applies_logit_bias(url):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "best_of": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "logit_bias": {"77": 100}}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# ---- a client leaving a batch ------------------------------------------------------------------

SLOTS, LONG = 3, 240


@pytest.fixture(scope="module")
def roomy(tiny_ckpt_ro):
    """An eager service of SLOTS slots and a 256-token context: a batch that holds every slot."""
    launched, _ = launch(tiny_ckpt_ro, backend="eager", max_slots=SLOTS, max_seq=256, validate_tokens=1)
    try:
        with app_server(launched) as url:
            yield url
    finally:
        launched.close()


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def _until(check, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def _generated(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("dsv4_generated_tokens_total "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_cancels_every_prompt_of_its_batch(roomy, stream):
    url = roomy
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"prompt": [[1, 2, 3], [4, 5], [6]], "max_tokens": LONG, "ignore_eos": True,
                       "stream": stream}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    _until(lambda: _health(url)["free_slots"] == 0)  # every prompt holds a slot
    sock.close()
    at_close = _generated(url)
    _until(lambda: _health(url)["free_slots"] == SLOTS)
    assert _generated(url) - at_close <= 2 * SLOTS  # the step in flight, at most one more, per prompt
    assert _ok(url, {"prompt": [[7]] * SLOTS, "max_tokens": 1})["usage"]["completion_tokens"] == SLOTS
