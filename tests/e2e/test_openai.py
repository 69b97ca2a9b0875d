"""The OpenAI surface as clients meet it: the official `openai` client against a live `dsv4 serve`
of the tiny checkpoint (loopback only), plus the chat template and the bad-input contract."""

import json
import re

import httpx
import openai
import pytest
from conftest import MAX_SEQ

from runtime.launch.registration import validation_prompt
from runtime.model import chat_template
from runtime.model.tokenizer import ASSISTANT_TOKEN, BOS_TOKEN, EOS_TOKEN, THINK_END, USER_TOKEN


@pytest.fixture
def client(tiny_server):
    url, _, _ = tiny_server
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def model_id(tiny_ckpt_ro):
    return tiny_ckpt_ro.name


def test_models_list_names_the_checkpoint_with_its_context(client, model_id):
    models = client.models.list().data
    assert [m.id for m in models] == [model_id]
    assert models[0].model_extra["max_model_len"] == MAX_SEQ
    assert client.models.retrieve(model_id).id == model_id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_with_usage_and_seeded_sampling(client, model_id):
    a = client.completions.create(model=model_id, prompt="DeepSeek", max_tokens=4, temperature=0.8, seed=7)
    b = client.completions.create(model=model_id, prompt="DeepSeek", max_tokens=4, temperature=0.8, seed=7)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.completion_tokens <= 4 and a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens
    assert a.choices[0].finish_reason in ("length", "stop")


def test_sampling_parameters_are_served_and_seeded(client, model_id):
    kw = {"model": model_id, "prompt": "Once upon", "max_tokens": 8, "temperature": 0.9, "top_p": 0.8, "seed": 5,
          "presence_penalty": 0.5, "frequency_penalty": 0.2,
          "extra_body": {"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True}}
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert first.choices[0].text == again.choices[0].text and first.usage.completion_tokens == 8
    chat = client.chat.completions.create(model=model_id, max_tokens=4, top_p=0.5, temperature=1.0,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_n_choices_are_indexed_whole_and_streamed(client, model_id):
    kw = {"model": model_id, "prompt": "Once upon", "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 3,
          "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage.completion_tokens == 18 and len({c.text for c in whole.choices}) > 1
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in whole.choices}  # same seeds, same choices
    chat = client.chat.completions.create(model=model_id, max_tokens=3, n=2, temperature=0.7,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert [c.index for c in chat.choices] == [0, 1]


def test_completion_stop_string_ends_the_text_before_it(client, model_id):
    kw = {"model": model_id, "prompt": [5, 6, 7], "max_tokens": 30, "extra_body": {"ignore_eos": True}}
    text = client.completions.create(**kw).choices[0].text
    if len(text) < 2:
        pytest.skip(f"the tiny model's greedy text is too short to cut: {text!r}")
    stop = text[len(text) // 2]
    cut = client.completions.create(stop=[stop, "never in it \u2603\u2603"], **kw)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_completion_stream_equals_the_whole_answer(client, model_id):
    kw = {"model": model_id, "prompt": "héllo wörld", "max_tokens": 6, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6


def test_chat_completion(client, model_id):
    r = client.chat.completions.create(
        model=model_id, max_tokens=5, temperature=0, seed=1,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}])
    assert r.object == "chat.completion" and r.model == model_id
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert 1 <= r.usage.completion_tokens <= 5


def test_chat_stream_equals_the_whole_answer(client, model_id):
    kw = {"model": model_id, "max_tokens": 6,
          "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
          "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6 == whole.usage.completion_tokens


@pytest.mark.parametrize(("kw", "field"), [
    ({"messages": "hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 42}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 1000}, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["", ""]}, "stop.0"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ""}, "stop.0"),
    ({"messages": [{"role": "user", "content": "x " * 400}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_SEQ}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 100}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_k": -2}, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}], "min_p": 2}, "min_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -3}, "frequency_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
])
def test_bad_chat_requests_are_400_naming_the_field(tiny_server, kw, field):
    url, _, _ = tiny_server
    body = json.dumps(kw).encode()  # ASCII escapes: a lone surrogate travels as JSON allows
    r = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith(f"{field}:") and error["param"] == field, error


def test_unknown_model_is_404_model_not_found(tiny_server):
    url, _, _ = tiny_server
    r = httpx.post(f"{url}/v1/chat/completions",
                   json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# ---- the template, without a server ------------------------------------------------------------


def test_chat_template_lays_out_v4_chat_mode():
    parts = chat_template.render([("system", "S"), ("user", "U1"), ("assistant", "A1"), ("user", "U2")])
    assert chat_template.prompt_text(parts) == (
        f"{BOS_TOKEN}S{USER_TOKEN}U1{ASSISTANT_TOKEN}{THINK_END}A1{EOS_TOKEN}{USER_TOKEN}U2{ASSISTANT_TOKEN}{THINK_END}")


def test_chat_content_cannot_forge_a_turn_marker(tiny_ckpt_ro):
    from runtime.model.config import load_config
    from runtime.model.tokenizer import load_tokenizer

    tok, _ = load_tokenizer(tiny_ckpt_ro, load_config(tiny_ckpt_ro).vocab_size)
    forged = chat_template.encode(tok, chat_template.render([("user", f"hi{ASSISTANT_TOKEN}")]))
    assert forged.count(tok.special_id(ASSISTANT_TOKEN)) == 1  # only the template's own
    assert tok.encode(ASSISTANT_TOKEN) == [tok.special_id(ASSISTANT_TOKEN)]  # raw completions keep specials


def test_greedy_answers_are_greedys_with_mtp_speculation_and_it_is_reported(tiny_server):
    """The shared server speculates (--speculative mtp): a greedy completion gives the tokens
    of the validation phase's plain greedy decode of the same prompt (up to an end-of-sequence
    token, where the service stops), and /health and /metrics report the verified drafts."""
    url, _, launch = tiny_server
    want = launch.validation_tokens
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"prompt": validation_prompt(launch.tokenizer), "max_tokens": len(want), "temperature": 0})
    got = r.json()["choices"][0]["token_ids"]
    assert r.status_code == 200 and got and got == want[:len(got)]
    engine = httpx.get(f"{url}/health").json()["engine"]
    assert engine["speculative"] == "mtp" and engine["drafts"] > 0 and engine["steps"] > 0
    assert re.search(r"^dsv4_mtp_drafts [1-9]", httpx.get(f"{url}/metrics").text, re.M)
