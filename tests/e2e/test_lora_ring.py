"""LoRA adapters on the launched ring, loaded at run time: load, use, unload while a stream runs
on the adapter, reload; an unloaded adapter is an unknown model (404); bad adapters are refused
with a message naming the fault while the ring keeps serving; the LoRA gauge goes back to
its baseline. (Logits against transformers + peft: tests/scheduler/test_lora.py.)"""

from __future__ import annotations

import json
import threading

import grpc
import httpx
import pytest
import torch
from safetensors.torch import save_file

from ringserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tests.helpers.ringstack import still_serves

GAUGE = "ringserve:lora_requests_info"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def write_adapter(path, rank: int = 4, targets=("q_proj", "v_proj"), shapes=None, seed: int = 0) -> str:
    """A PEFT-format adapter on SmolLM2's shapes (30 layers, hidden 576, 3 KV heads of 64), with
    weights large enough to change the greedy answer."""
    shapes = shapes or {"q_proj": (576, 576), "v_proj": (576, 192)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(30):
        for module in targets:
            fan_in, fan_out = shapes[module]
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.5
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets)}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def lora_gauge(stack) -> tuple[str, str, str]:
    """(running adapters, waiting adapters, max) from the scheduler's one lora_requests_info sample."""
    scraped = stack.scrape("scheduler")
    samples = [labels for (name, labels) in scraped if name == GAUGE]
    assert len(samples) == 1, samples
    # The endpoint picker reads vLLM's name: the same labels.
    assert [labels for (name, labels) in scraped if name == "vllm:lora_requests_info"] == samples
    labels = dict(samples[0])
    return labels["running_lora_adapters"], labels["waiting_lora_adapters"], labels["max_lora"]


def chat(stack, model: str, **kw) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=120, headers=stack.http_headers, json={
        "model": model, "messages": QUESTION, "max_tokens": 12, "temperature": 0, **kw})


def post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", json=body, timeout=60, headers=stack.http_headers)


class Stream(threading.Thread):
    """A greedy chat stream of ``max_tokens`` (ignore_eos) read in a thread; ``started`` is set
    at its first chunk; ``text`` and ``finish`` once it ends."""

    def __init__(self, stack, model: str, max_tokens: int):
        super().__init__()
        self.stack, self.model, self.max_tokens = stack, model, max_tokens
        self.started = threading.Event()
        self.chunks: list[dict] = []
        self.start()

    def run(self) -> None:
        stack = self.stack
        with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", timeout=120, headers=stack.http_headers,
                          json={"model": self.model, "messages": QUESTION, "max_tokens": self.max_tokens,
                                "temperature": 0, "ignore_eos": True, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(json.loads(line[6:]))
                    self.started.set()

    def result(self) -> tuple[str, str]:
        self.join(120)
        choices = [c["choices"][0] for c in self.chunks if c["choices"]]
        return "".join(c["delta"].get("content") or "" for c in choices), choices[-1]["finish_reason"]


def test_lora_load_use_unload_reload(stack, tmp_path):
    assert lora_gauge(stack) == ("", "", "4")
    base_stream = Stream(stack, stack.model_name, 48)  # runs on the base model through all of it
    assert base_stream.started.wait(60)
    path = write_adapter(tmp_path / "tiny")
    r = post(stack, "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": path})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'tiny' added successfully.")
    models = httpx.get(f"{stack.base_url}/v1/models", headers=stack.http_headers).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [(stack.model_name, None), ("tiny", stack.model_name)]
    assert models[1]["root"] == path

    first = chat(stack, "tiny", max_tokens=40, ignore_eos=True)
    assert first.status_code == 200 and first.json()["model"] == "tiny"
    answer = first.json()["choices"][0]["message"]["content"]
    base = chat(stack, stack.model_name)
    assert answer != base.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."

    # Unload while a stream runs on the adapter: its name goes at once, the stream ends on the
    # adapter's weights (the same text as before), its slot frees after it.
    tiny_stream = Stream(stack, "tiny", 40)
    assert tiny_stream.started.wait(60)
    assert lora_gauge(stack)[0] == "tiny"
    r = post(stack, "/v1/unload_lora_adapter", {"lora_name": "tiny"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'tiny' removed successfully.")
    models = httpx.get(f"{stack.base_url}/v1/models", headers=stack.http_headers).json()["data"]
    assert [m["id"] for m in models] == [stack.model_name]
    assert tiny_stream.result() == (answer, "length")

    gone = chat(stack, "tiny")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    r = post(stack, "/v1/unload_lora_adapter", {"lora_name": "tiny"})
    assert r.status_code == 404 and "no LoRA adapter named 'tiny' is loaded" in r.json()["error"]["message"]

    assert post(stack, "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": path}).status_code == 200
    again = chat(stack, "tiny", max_tokens=40, ignore_eos=True)  # the same weights again: the same answer
    assert again.json()["choices"][0]["message"]["content"] == answer
    assert post(stack, "/v1/unload_lora_adapter", {"lora_name": "tiny"}).status_code == 200
    whole = chat(stack, stack.model_name, max_tokens=48, ignore_eos=True).json()["choices"][0]["message"]["content"]
    assert base_stream.result() == (whole, "length")
    stack.wait_idle()
    assert lora_gauge(stack) == ("", "", "4")


def test_bad_adapters_are_refused_and_the_ring_serves(stack, tmp_path):
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path / "absent")}, 400, "no adapter_config.json"),
        ({"lora_name": "x", "lora_path": write_adapter(tmp_path / "big", rank=65)}, 400,
         "rank 65 is over --max-lora-rank 64"),
        ({"lora_name": "x", "lora_path": write_adapter(tmp_path / "shape", shapes={"q_proj": (576, 575),
                                                                                  "v_proj": (576, 192)})},
         400, "expected [576, 4]"),
        ({"lora_name": stack.model_name, "lora_path": write_adapter(tmp_path / "ok")}, 400, "the base model's name"),
        ({"lora_name": "x"}, 400, "lora_path"),
        ({"lora_name": "é" * 257, "lora_path": write_adapter(tmp_path / "ok2")}, 400,
         "lora_name: longer than 256 characters (257)"),
        ({"lora_name": "x", "lora_path": "/" + "é" * 1024}, 400, "lora_path: longer than 1024 characters (1025)"),
    ]
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "target_modules": ["embed_tokens"]}))
    save_file({"a": torch.zeros(1)}, str(tmp_path / "target" / "adapter_model.safetensors"))
    cases.append(({"lora_name": "x", "lora_path": str(tmp_path / "target")}, 400,
                  "unknown target module(s) ['embed_tokens']"))
    for body, status, message in cases:
        r = post(stack, "/v1/load_lora_adapter", body)
        assert r.status_code == status, (body, r.text)
        assert message in r.json()["error"]["message"], (body, r.text)
        assert "scheduler" not in r.json()["error"]["message"], r.text  # no internal address
    models = httpx.get(f"{stack.base_url}/v1/models", headers=stack.http_headers).json()["data"]
    assert [m["id"] for m in models] == [stack.model_name]
    with grpc.insecure_channel(stack.tokenizer) as channel:  # gRPC: an unknown adapter ends the call NOT_FOUND
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        listed = stub.ListLoraAdapters(common_pb2.Empty(), timeout=10, metadata=stack.grpc_metadata)
        assert (list(listed.adapters), listed.max_loras) == ([], 4)
        call = stub.Generate(tokenizer_pb2.GenerateReqInput(text="hi", lora_name="nope"), timeout=30,
                             metadata=stack.grpc_metadata)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.NOT_FOUND,
                                                           "The model 'nope' does not exist")
    assert lora_gauge(stack) == ("", "", "4")
    still_serves(stack)
