"""Prompt logprobs through the whole ring (fp32 SmolLM2): OpenAI completions'
``echo`` + ``logprobs`` (and ``max_tokens: 0`` to score only), vLLM's ``prompt_logprobs``
on completions and chat, SGLang's ``/generate`` ``logprob_start_len``, and the gRPC API;
values equal transformers' log-softmax (1e-4), on a cold and on a cached prompt."""

from __future__ import annotations

import json
import math

import grpc
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from ringserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

TEXT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt(stack):
    r = httpx.post(f"{stack.base_url}/v1/tokenize", json={"model": stack.model_name, "prompt": TEXT}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def expected(reference, prompt):
    """logprob of token p given prompt[:p], for p >= 1, and the top-2 (values, ids)."""
    with torch.no_grad():
        logp = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), dim=-1)[:-1]
    return logp.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1).tolist(), logp.topk(2, dim=-1)


def post(stack, path: str, body: dict) -> httpx.Response:
    model = {} if path == "/generate" else {"model": stack.model_name}
    return httpx.post(f"{stack.base_url}{path}", json={**model, **body}, timeout=120)


@pytest.mark.parametrize("attempt", ["cold", "cached"])
def test_echo_logprobs_with_max_tokens_0_scores_the_prompt(stack, prompt, expected, attempt):
    r = post(stack, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the scored range bypasses the cache
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) and "".join(lp["tokens"]) == TEXT
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want, (top_vals, _top_ids) = expected
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], want, strict=True)) < 1e-4
    for got, vals in zip(lp["top_logprobs"][1:], top_vals.tolist(), strict=True):
        assert sorted(got.values(), reverse=True) == pytest.approx(vals, abs=1e-4)
    assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]


def test_echo_logprobs_then_generated_tokens_stream_equals_non_stream(stack, prompt, expected):
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0}
    whole = post(stack, "/v1/completions", body).json()["choices"][0]
    lp = whole["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 4
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:len(prompt)], expected[0], strict=True)) < 1e-4
    assert whole["text"] == "".join(lp["tokens"])
    tokens, logprobs, text = [], [], ""
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", timeout=120,
                      json={"model": stack.model_name, **body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                text += c["text"]
                if c["logprobs"]:
                    tokens += c["logprobs"]["tokens"]
                    logprobs += c["logprobs"]["token_logprobs"]
    assert text == whole["text"] and tokens == lp["tokens"]
    assert logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(logprobs[1:], lp["token_logprobs"][1:], strict=True)) < 1e-4


def test_vllm_prompt_logprobs_on_completions_and_chat(stack, prompt, expected):
    r = post(stack, "/v1/completions", {"prompt": prompt, "prompt_logprobs": 1, "max_tokens": 1})
    assert r.status_code == 200, r.text
    pl = r.json()["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(prompt) and pl[0] is None
    for p, token, want in zip(pl[1:], prompt[1:], expected[0], strict=True):
        assert abs(p[str(token)]["logprob"] - want) < 1e-4 and 1 <= len(p) <= 2
    chat = post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                               "prompt_logprobs": 0, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    pl = chat.json()["prompt_logprobs"]
    assert pl[0] is None and all(len(p) == 1 for p in pl[1:]) and len(pl) == chat.json()["usage"]["prompt_tokens"]
    bad = post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                              "prompt_logprobs": 0, "stream": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"
    bad = post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_sglang_generate_logprob_start_len(stack, prompt, expected):
    r = post(stack, "/generate", {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 3,
                                  "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == prompt[3:]
    assert max(abs(lp - want) for (lp, _, _), want in zip(got, expected[0][2:], strict=True)) < 1e-4
    assert all(len(top) == 2 for top in meta["input_top_logprobs"])
    assert len(meta["output_token_logprobs"]) == 2
    bad = post(stack, "/generate", {"input_ids": prompt, "return_logprob": True, "logprob_start_len": len(prompt)})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprob_start_len", bad.text
    stack.wait_idle(timeout_s=5)


def test_grpc_prompt_logprobs(stack, prompt, expected):
    req = tokenizer_pb2.GenerateReqInput(
        rid="grpc-prompt-logprobs", input_ids=tokenizer_pb2.TokenIds(ids=prompt), logprob_start_len=0,
        sampling_params=common_pb2.SamplingParams(max_new_tokens=0))
    with grpc.insecure_channel(stack.tokenizer) as ch:
        outs = list(tokenizer_pb2_grpc.TokenizerStub(ch).Generate(req, timeout=60))
    p = outs[-1].prompt_logprobs
    assert list(p.token_ids) == prompt and p.start == 1 and len(p.logprobs) == len(prompt) - 1
    assert max(abs(a - b) for a, b in zip(p.logprobs, expected[0], strict=True)) < 1e-4
    assert outs[-1].completion_tokens == 0 and outs[-1].finish_reason.type == common_pb2.FINISH_LENGTH
    assert not math.isnan(sum(p.logprobs))


def test_lm_eval_local_completions_batch(stack, prompt, expected):
    """lm-eval's local-completions loglikelihood request: a batch of token-id prompts,
    echo, logprobs 1, max_tokens 0, temperature 0; the continuation's sum and greediness
    come from token_logprobs and top_logprobs."""
    ctx = len(prompt) - 3
    r = post(stack, "/v1/completions", {"prompt": [prompt, prompt[:ctx + 1]], "echo": True, "logprobs": 1,
                                        "max_tokens": 0, "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    want, (_vals, top_ids) = expected
    for choice, end in zip(choices, (len(prompt), ctx + 1), strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == end
        got = sum(lp["token_logprobs"][ctx:])
        assert got == pytest.approx(sum(want[ctx - 1:end - 1]), abs=1e-4)
        pairs = zip(lp["top_logprobs"][ctx:], lp["tokens"][ctx:], strict=True)
        greedy = all(max(top, key=top.get) == tok for top, tok in pairs)
        assert greedy == bool((top_ids[ctx - 1:end - 1, 0] == torch.tensor(prompt[ctx:end])).all())
