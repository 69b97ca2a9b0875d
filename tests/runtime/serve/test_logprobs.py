"""Log-probabilities as OpenAI clients read them (issue 27): completions' `logprobs: k` and
`echo` (lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 0), chat's `logprobs` +
`top_logprobs`, whole and streamed, through the official `openai` client's types; a greedy
token's log-probability is the log-softmax of the reference forward pass at its position."""

from __future__ import annotations

import pytest
from eager_reference import eager_model

PROMPT = [3, 17, 250, 9, 41, 8]
TOL = 2e-3  # the service's batched steps sum in another order than the reference's


@pytest.fixture
def client(tiny_app):
    url, _ = tiny_app
    import openai  # the client, for the tests that use it: collection stays light

    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_ckpt_ro):
    """log-softmax of the eager forward pass over PROMPT and the greedy continuation."""
    log_softmax, engine = eager_model(tiny_ckpt_ro)
    tokens = list(engine().generate(PROMPT, 4))
    return tokens, log_softmax(PROMPT + tokens)


def test_greedy_completion_logprobs_are_the_reference_log_softmax(client, tiny_ckpt_ro, reference):
    tokens, lp = reference
    r = client.completions.create(model=tiny_ckpt_ro.name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    got = r.choices[0].logprobs
    assert r.choices[0].model_extra["token_ids"] == tokens
    assert len(got.tokens) == len(got.token_logprobs) == len(got.top_logprobs) == len(got.text_offset) == 4
    for i, token in enumerate(tokens):
        want = float(lp[len(PROMPT) - 1 + i, token])
        assert got.token_logprobs[i] == pytest.approx(want, abs=TOL)
        assert max(got.top_logprobs[i].values()) == pytest.approx(got.token_logprobs[i], abs=1e-6)  # greedy: the top
        assert 1 <= len(got.top_logprobs[i]) <= 4  # keyed by text: pieces of one UTF-8 character share "�"
    assert got.text_offset == sorted(got.text_offset) and got.text_offset[0] == 0


def test_echo_with_max_tokens_0_scores_the_prompt(client, tiny_ckpt_ro, reference):
    _, lp = reference
    r = client.completions.create(model=tiny_ckpt_ro.name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    choice_lp = choice.logprobs
    assert r.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert len(choice_lp.tokens) == len(PROMPT) and choice_lp.token_logprobs[0] is None
    assert choice.text == "".join(choice_lp.tokens)
    for i in range(1, len(PROMPT)):
        assert choice_lp.token_logprobs[i] == pytest.approx(float(lp[i - 1, PROMPT[i]]), abs=TOL)


def test_streamed_logprobs_equal_the_whole_answers(client, tiny_ckpt_ro):
    kw = {"model": tiny_ckpt_ro.name, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 2,
          "echo": True, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices]
    streamed = [lp for lp in chunks if lp is not None]
    assert [t for c in streamed for t in c.tokens] == whole.tokens
    flat = [lp for c in streamed for lp in c.token_logprobs]
    assert flat[0] is None and whole.token_logprobs[0] is None
    assert flat[1:] == pytest.approx(whole.token_logprobs[1:], abs=1e-5)
    assert [o for c in streamed for o in c.text_offset] == whole.text_offset


def test_chat_logprobs_and_top_logprobs(client, tiny_ckpt_ro):
    kw = {"model": tiny_ckpt_ro.name, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2,
          "messages": [{"role": "user", "content": "Hi"}], "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 4
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.bytes == list(t.token.encode())
    streamed = [t for c in client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)


@pytest.mark.parametrize(("path", "kw", "field"), [
    ("completions", {"prompt": [1, 2], "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": [1, 2], "logprobs": -1}, "logprobs"),
    ("completions", {"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
])
def test_out_of_range_logprobs_are_400s_naming_the_field(tiny_app, path, kw, field):
    import httpx

    url, _ = tiny_app
    r = httpx.post(f"{url}/v1/{path}", json=kw, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
