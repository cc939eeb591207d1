"""LoRA adapters at the gateway: the model a request names picks the adapter the tokenizer
gets (lora_name), /v1/models lists adapters with their parent, the load and unload endpoints
pass vLLM's bodies on and map refusals to the API's errors."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.asyncio(loop_scope="session")

QUESTION = [{"role": "user", "content": "x"}]


@pytest.fixture
def tiny(stack):
    stack.fake.adapters = {"tiny": "/adapters/tiny"}
    yield
    stack.fake.adapters = {}


async def test_model_picks_the_adapter_on_every_endpoint(stack, tiny):
    calls = [
        ("/v1/chat/completions", {"model": "tiny", "messages": QUESTION}),
        ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}),
        ("/v1/responses", {"model": "tiny", "input": "x"}),
        ("/generate", {"text": "a", "lora_path": "tiny"}),
    ]
    for path, body in calls:
        stack.fake.reset(stack.out("ok", finish="stop"))
        r = await stack.client.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
        assert [q.lora_name for q in stack.fake.requests] == ["tiny"] * len(stack.fake.requests) != [], path
        if path != "/generate":
            assert r.json()["model"] == "tiny"
    stack.fake.reset(stack.out("ok", finish="stop"))
    r = await stack.client.post("/v1/chat/completions", json={"model": stack.model, "messages": QUESTION})
    assert r.json()["model"] == "smol" and stack.fake.requests[0].lora_name == ""


async def test_unknown_adapter_is_model_not_found(stack, tiny):
    for path, body in [("/v1/chat/completions", {"model": "tinier", "messages": QUESTION}),
                       ("/generate", {"text": "a", "lora_path": "tinier"})]:
        stack.fake.reset(stack.out("ok", finish="stop"))
        r = await stack.client.post(path, json=body)
        assert r.status_code == 404 and r.json()["error"] == {
            "message": "The model 'tinier' does not exist; this server serves 'smol'", "type": "invalid_request_error",
            "param": "model", "code": "model_not_found"}
        assert stack.fake.requests == []


async def test_models_list_adapters_with_their_parent(stack, tiny):
    data = (await stack.client.get("/v1/models")).json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in data] == [
        ("smol", "/models/SmolLM2", None), ("tiny", "/adapters/tiny", "smol")]
    assert data[1]["max_model_len"] == 2048
    for entry in data:  # /v1/models/{id} answers each one's entry as the list has it
        assert (await stack.client.get(f"/v1/models/{entry['id']}")).json() == entry


async def test_load_and_unload_endpoints(stack):
    r = await stack.client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/adapters/a"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'a' added successfully.")
    assert stack.fake.adapters == {"a": "/adapters/a"}
    r = await stack.client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/elsewhere/b"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "adapter /elsewhere/b: no adapter_config.json"
    r = await stack.client.post("/v1/load_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = await stack.client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'a' removed successfully.")
    r = await stack.client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "no LoRA adapter named 'a' is loaded"
    assert stack.fake.adapters == {}


async def test_lora_endpoints_need_the_api_key(keyed):
    r = await keyed.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/adapters/a"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = await keyed.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 401


async def test_embeddings_refuse_an_adapter(stack, tiny):
    r = await stack.client.post("/v1/embeddings", json={"model": "tiny", "input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert r.json()["error"]["message"] == ("embeddings are not served under a LoRA adapter ('tiny'); "
                                            "name the base model")
