"""The OpenAPI document tells the truth: every request body is the model the routes parse with,
every answer a model — and real answers of the service validate against those models."""

from __future__ import annotations

import json

import pytest
from door_fakes import fake_launched, served
from pydantic import TypeAdapter

from runtime.contract import Health
from runtime.serve import schema


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    with served(fake_launched(tmp_path_factory.mktemp("openapi"))) as s:
        yield s


@pytest.fixture(scope="module")
def doc(svc):
    return svc.get("/openapi.json").json()


def _resolve(doc, ref: str) -> dict:
    assert ref.startswith("#/components/schemas/")
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]]


@pytest.mark.parametrize(("path", "request_model", "fields"), [
    ("/v1/completions", "CompletionRequest", {"prompt", "max_tokens", "logprobs", "echo", "best_of", "n", "stop",
                                              "temperature", "top_p", "logit_bias", "stream", "seed"}),
    ("/v1/chat/completions", "ChatRequest", {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                             "temperature", "stream"}),
])
def test_each_generation_route_declares_its_body_and_every_answer(doc, path, request_model, fields):
    post = doc["paths"][path]["post"]
    body = post["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": f"#/components/schemas/{request_model}"} and post["requestBody"]["required"]
    properties = _resolve(doc, body["$ref"])["properties"]
    assert fields <= set(properties)
    assert properties["temperature"]["anyOf"][0]["maximum"] == 2.0
    answers = post["responses"]
    assert {"200", "400", "401", "408", "413", "503"} <= set(answers)
    assert set(answers["200"]["content"]) == {"application/json", "text/event-stream"}
    assert answers["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")


def test_metrics_is_text_and_health_the_contract(doc):
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    health = doc["paths"]["/health"]["get"]["responses"]
    assert health["503"]["content"]["application/json"]["schema"]["$ref"].endswith("/Health")
    assert "open_fds" in doc["components"]["schemas"]["Health"]["properties"]
    for path in ("/v1/models", "/v1/models/{model}"):
        assert doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_real_answers_validate_against_the_documented_models(svc):
    whole = svc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 2, "echo": True, "n": 2})
    schema.Completion.model_validate(whole.json())
    stream = svc.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "stream": True, "logprobs": 1,
                                               "stream_options": {"include_usage": True}})
    for event in _events(stream.text):
        schema.Completion.model_validate(event)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    schema.ChatCompletion.model_validate(svc.post("/v1/chat/completions", json=chat).json())
    for event in _events(svc.post("/v1/chat/completions", json={**chat, "stream": True}).text):
        schema.ChatCompletionChunk.model_validate(event)
    schema.ModelList.model_validate(svc.get("/v1/models").json())
    model_id = svc.get("/v1/models").json()["data"][0]["id"]
    schema.ModelCard.model_validate(svc.get(f"/v1/models/{model_id}").json())
    TypeAdapter(Health).validate_python(svc.get("/health").json())
    for bad in (svc.post("/v1/completions", json={"prompt": [1], "top_p": 7}), svc.get("/v1/models/nope"),
                svc.post("/v1/completions", content=b"{")):
        assert bad.status_code in (400, 404)
        schema.ErrorBody.model_validate(bad.json())
