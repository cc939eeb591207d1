"""LangChain and instructor, unchanged, against the default ring (``stack``): tool calls and
structured output through the paths those libraries take (a forced tool call, a
``json_schema`` response format). SmolLM2 is tiny, so every answer here is constrained (a
forced tool choice, a schema with bounded strings and numbers) and structurally valid by
construction (the models close their objects, ``extra="forbid"``, as OpenAI's strict mode
would); each test checks the exact structure and that what the library parsed is
what the server sent (every response body is recorded off the wire)."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import instructor
import openai
import pytest
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field


class Closed(BaseModel):
    # additionalProperties: false in the schema: without it JSON Schema allows any other key,
    # and a small model adds keys until max_tokens.
    model_config = ConfigDict(extra="forbid")


class GetWeather(Closed):
    """Get the weather forecast for a city."""

    city: str = Field(max_length=16)
    days: int = Field(ge=1, le=7)


class Person(Closed):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


class Cat(Closed):
    kind: Literal["cat"]
    name: str = Field(max_length=12)


class Dog(Closed):
    kind: Literal["dog"]
    age: int = Field(ge=0, le=30)


class Pet(Closed):
    pet: Cat | Dog = Field(discriminator="kind")  # JSON schema: a oneOf told apart by "kind"


class Wire:
    """An httpx client that records every chat-completion response body the server sent."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.client = httpx.Client(timeout=120, event_hooks={"response": [self._record]})

    def _record(self, response: httpx.Response) -> None:
        response.read()
        assert response.status_code == 200, response.text
        self.bodies.append(response.json())

    def message(self) -> dict:
        """The only response's message."""
        (body,) = self.bodies
        (choice,) = body["choices"]
        return choice["message"]


@pytest.fixture
def wire():
    w = Wire()
    yield w
    w.client.close()


def langchain(stack, wire: Wire) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", model=stack.model_name, temperature=0,
                      max_tokens=64, max_retries=0, http_client=wire.client)


def openai_client(stack, wire: Wire) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, http_client=wire.client)


def test_langchain_bind_tools_with_a_forced_choice_returns_the_call(stack, wire):
    llm = langchain(stack, wire).bind_tools([GetWeather], tool_choice="GetWeather")
    reply = llm.invoke("What is the weather in Paris for the next 3 days?")
    assert isinstance(reply, AIMessage)
    (call,) = reply.tool_calls
    sent = wire.message()
    (sent_call,) = sent["tool_calls"]
    assert (call["name"], call["id"]) == ("GetWeather", sent_call["id"])
    assert call["args"] == json.loads(sent_call["function"]["arguments"])
    assert sorted(call["args"]) == ["city", "days"]
    GetWeather.model_validate(call["args"])
    assert wire.bodies[0]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output_returns_the_parsed_model(stack, wire, method):
    structured = langchain(stack, wire).with_structured_output(Person, method=method)
    person = structured.invoke("Ada Lovelace was 36 years old. Describe her.")
    assert isinstance(person, Person)
    sent = wire.message()
    text = sent["tool_calls"][0]["function"]["arguments"] if method == "function_calling" else sent["content"]
    assert person == Person.model_validate_json(text)
    assert sorted(json.loads(text)) == ["age", "name"]


@pytest.mark.parametrize("mode,model,prompt", [
    (instructor.Mode.TOOLS, Person, "Ada Lovelace was 36 years old. Describe her."),
    (instructor.Mode.JSON_SCHEMA, Person, "Ada Lovelace was 36 years old. Describe her."),
    (instructor.Mode.JSON_SCHEMA, Pet, "Describe a pet."),
])
def test_instructor_returns_the_parsed_model(stack, wire, mode, model, prompt):
    client = instructor.from_openai(openai_client(stack, wire), mode=mode)
    parsed = client.chat.completions.create(model=stack.model_name, response_model=model, max_tokens=64,
                                            temperature=0, max_retries=0,
                                            messages=[{"role": "user", "content": prompt}])
    assert isinstance(parsed, model)  # instructor hands back a subclass of its own making
    sent = wire.message()
    text = sent["tool_calls"][0]["function"]["arguments"] if mode == instructor.Mode.TOOLS else sent["content"]
    assert parsed.model_dump() == model.model_validate_json(text).model_dump()
    assert sorted(json.loads(text)) == sorted(model.model_fields)
    if model is Pet:
        assert type(parsed.pet) is {"cat": Cat, "dog": Dog}[json.loads(text)["pet"]["kind"]]
