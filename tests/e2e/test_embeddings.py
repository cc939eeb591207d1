"""Embeddings through the whole ring (fp32 SmolLM2, last-token pooling, normalised): the openai
SDK's ``embeddings.create`` in both encodings, token-id inputs, a batch of 16 sent while 16
streams generate, and the gRPC ``Embed`` call all equal transformers' last hidden state pooled
the same way (1e-4); bad input is a 400 / INVALID_ARGUMENT naming its field; a cancelled call
frees everything and the ring goes back to idle."""

from __future__ import annotations

import asyncio
import base64
import struct
import threading

import grpc
import httpx
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from ringserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tests.helpers.ringstack import still_serves

TEXTS = [
    "The capital of France is Paris.",
    "def add(a, b):\n    return a + b",
    "社区非常活跃 — café naïve 👍🏽",
    "Rivers carve valleys; they carry silt from the mountains to the sea.",
]
BATCH = [f"Item {i}: {'a quick brown fox ' * (i % 5 + 1)}jumps over the lazy dog number {i * 7}." for i in range(16)]


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """text or ids -> (ids, transformers' last hidden state of the last token, L2-normalised)."""
    model = AutoModel.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)

    def embed(item: str | list[int]) -> tuple[list[int], torch.Tensor]:
        ids = tok(item)["input_ids"] if isinstance(item, str) else item
        with torch.no_grad():
            last = model(torch.tensor([ids])).last_hidden_state[0, -1]
        return ids, torch.nn.functional.normalize(last, dim=0)

    return embed


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def close(got, want: torch.Tensor) -> None:
    if isinstance(got, str):
        got = struct.unpack(f"<{len(want)}f", base64.b64decode(got))
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
def test_sdk_strings_and_ids_equal_transformers(stack, client, reference, encoding_format):
    """None: the SDK's default, which asks for base64 and decodes it; asked for by name, base64
    comes back as the text, decoded here as little-endian float32."""
    ids = reference(TEXTS[3])[0][:9]
    extra = {} if encoding_format is None else {"encoding_format": encoding_format}
    for given in (TEXTS, [ids, ids[:3]]):
        resp = client.embeddings.create(model=stack.model_name, input=given, user="tester", **extra)
        assert (resp.object, resp.model, [d.index for d in resp.data]) == ("list", stack.model_name,
                                                                          list(range(len(given))))
        lens = 0
        for item, d in zip(given, resp.data, strict=True):
            item_ids, want = reference(item)
            close(d.embedding, want)
            lens += len(item_ids)
        assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (lens, lens)
    stack.wait_idle()


def test_a_batch_of_16_while_16_streams_generate(stack, reference):
    """Sixteen streams decode while one request embeds 16 inputs in the same steps: the vectors
    are transformers', and every stream still gets all its tokens."""

    async def run():
        aclient = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        started = asyncio.Event()

        async def stream(i: int) -> tuple[int, str | None]:
            chunks = await aclient.completions.create(
                model=stack.model_name, prompt=f"Story {i}: once upon a time", max_tokens=48, temperature=0,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            tokens, finish = 0, None
            async for chunk in chunks:
                started.set()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            return tokens, finish

        streams = [asyncio.ensure_future(stream(i)) for i in range(16)]
        await asyncio.wait_for(started.wait(), 120)
        emb = await aclient.embeddings.create(model=stack.model_name, input=BATCH)
        generating = sum(not s.done() for s in streams)  # streams still going when the vectors came
        outs = await asyncio.gather(*streams)
        await aclient.close()
        return emb, outs, generating

    emb, outs, generating = asyncio.run(run())
    assert outs == [(48, "length")] * 16 and generating > 0
    for text, d in zip(BATCH, emb.data, strict=True):
        close(d.embedding, reference(text)[1])
    stack.wait_idle()


def test_grpc_embed_and_its_errors(stack, reference):
    ids = reference(TEXTS[0])[0]
    req = tokenizer_pb2.EmbedRequest(inputs=[tokenizer_pb2.EmbedInput(text=TEXTS[1]),
                                             tokenizer_pb2.EmbedInput(input_ids=tokenizer_pb2.TokenIds(ids=ids))])
    with grpc.insecure_channel(stack.tokenizer) as ch:
        stub = tokenizer_pb2_grpc.TokenizerStub(ch)
        resp = stub.Embed(req, timeout=60, metadata=stack.grpc_metadata)
        close(resp.embeddings[0].values, reference(TEXTS[1])[1])
        close(resp.embeddings[1].values, reference(ids)[1])
        assert [e.prompt_tokens for e in resp.embeddings] == [len(reference(TEXTS[1])[0]), len(ids)]
        bad = [
            (tokenizer_pb2.EmbedRequest(), "input", "input must not be empty"),
            (tokenizer_pb2.EmbedRequest(inputs=[tokenizer_pb2.EmbedInput(text="")]), "input",
             "input is an empty string"),
            (tokenizer_pb2.EmbedRequest(inputs=[tokenizer_pb2.EmbedInput(text="a")], dimensions=8), "dimensions",
             "dimensions is not supported by this model: its config.json declares no Matryoshka dimensions "
             "(is_matryoshka / matryoshka_dimensions); it embeds in 576"),
        ]
        for request, param, message in bad:
            with pytest.raises(grpc.RpcError) as info:
                stub.Embed(request, timeout=60, metadata=stack.grpc_metadata)
            err = info.value
            assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
            assert ("param", param) in tuple(err.trailing_metadata())
    stack.wait_idle()


@pytest.mark.parametrize("body,message", [
    ({"input": [1] * 8193}, "This model's maximum context length is 8192 tokens. However, input has 8193 tokens. "
                            "Please reduce the length of the input."),
    ({"input": [[1, 2], [49152]]}, "input[1]: token id 49152 is outside the vocabulary [0, 49152)"),
    ({"input": ""}, "input is empty"),
    ({"input": "a", "dimensions": 8}, None),
])
def test_http_bad_input_is_a_400_naming_the_field(stack, body, message):
    r = httpx.post(f"{stack.base_url}/v1/embeddings", json={"model": stack.model_name, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == ("dimensions" if "dimensions" in body else "input")
    if message is not None:
        assert error["message"] == message


def _queued(load: common_pb2.LoadReport) -> int:
    return load.num_running_reqs + load.num_waiting_reqs


def test_a_cancelled_embed_frees_its_slots_and_streams_go_on(stack):
    """A gRPC Embed call of 64 long inputs cancelled while they prefill: every input is aborted,
    a stream started beside it finishes with all its tokens, and every gauge is back to zero."""
    long_text = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 60
    req = tokenizer_pb2.EmbedRequest(inputs=[tokenizer_pb2.EmbedInput(text=f"{i} {long_text}") for i in range(64)])
    aborted_before = stack.scheduler_load().num_aborted_reqs
    result: dict = {}

    def generate() -> None:
        r = httpx.post(f"{stack.base_url}/v1/completions", timeout=120, json={
            "model": stack.model_name, "prompt": "Count: 1 2 3", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True})
        result["usage"] = r.json()["usage"]

    with grpc.insecure_channel(stack.tokenizer) as ch:
        call = tokenizer_pb2_grpc.TokenizerStub(ch).Embed.future(req, timeout=120, metadata=stack.grpc_metadata)
        # Wait for the embed's inputs to reach the scheduler before the stream starts, so the
        # slots seen are the embed's and the cancel has requests there to abort.
        deadline = 400
        while not _queued(stack.scheduler_load()) and deadline:
            deadline -= 1
            threading.Event().wait(0.05)
        assert stack.scheduler_load().req_slots_used > 0
        beside = threading.Thread(target=generate)
        beside.start()
        call.cancel()
        beside.join(120)
    assert call.cancelled()
    assert result["usage"]["completion_tokens"] == 16
    stack.wait_idle(timeout_s=30)
    assert stack.scheduler_load().num_aborted_reqs > aborted_before
    load = httpx.get(f"{stack.base_url}/get_load", timeout=30).json()
    assert [(s["num_running_reqs"], s["num_waiting_reqs"], s["req_slots_used"], s["kv_used_tokens"])
            for s in load["scheduler"]] == [(0, 0, 0, 0)]
    assert [t["req_states"] for t in load["tokenizer"]] == [0]
    assert [d["decode_states"] for d in load["detokenizer"]] == [0]
    still_serves(stack)
