"""Non-stream bodies, what reaches the tokenizer (GenerateReqInput), and the other endpoints."""

from __future__ import annotations

import orjson
import pytest

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = "/v1/chat/completions"


async def test_chat_non_stream_body(stack):
    stack.fake.reset(stack.out("Paris.", finish="stop", completion=3, matched_token_id=2))
    body = {"model": stack.model, "messages": [{"role": "user", "content": "Capital of France?"}], "rid": "abc"}
    r = await stack.client.post(CHAT, json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    got = r.json()
    assert got["id"] == "chatcmpl-abc" and got["object"] == "chat.completion" and got["model"] == "smol"
    assert isinstance(got["created"], int) and got["system_fingerprint"]
    message = {"role": "assistant", "content": "Paris.", "tool_calls": None}
    assert got["choices"] == [
        {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop", "matched_stop": 2}]
    assert got["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                            "prompt_tokens_details": {"cached_tokens": 3}}
    req = stack.fake.requests[0]
    assert req.rid == "abc" and not req.stream


async def test_chat_n2_non_stream(stack):
    o = stack.out
    stack.fake.reset(o("B", index=1, finish="length", completion=4), o("A", index=0, finish="stop", completion=2))
    body = {"model": stack.model, "messages": [{"role": "user", "content": "x"}], "n": 2}
    got = (await stack.client.post(CHAT, json=body)).json()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in got["choices"]] == [
        (0, "A", "stop"), (1, "B", "length")]
    assert got["usage"]["completion_tokens"] == 6 and got["usage"]["prompt_tokens"] == 7


async def test_sampling_params_only_what_was_given(stack):
    stack.fake.reset(stack.out("x", finish="stop"))
    body = {
        "model": stack.model, "messages": [{"role": "user", "content": "x"}],
        "temperature": 0, "max_tokens": 50, "max_completion_tokens": 20, "stop": "END", "seed": 7,
        "logit_bias": {"42": -100}, "include_stop_str_in_output": True, "min_tokens": 2, "top_k": 5,
        "stop_token_ids": [9], "ignore_eos": False, "frequency_penalty": 0.5, "user": "u1",
    }
    assert (await stack.client.post(CHAT, json=body)).status_code == 200
    sp = stack.fake.requests[0].sampling_params
    assert sp.HasField("temperature") and sp.temperature == 0
    assert sp.max_new_tokens == 20  # max_completion_tokens wins over the deprecated max_tokens
    assert list(sp.stop) == ["END"] and list(sp.stop_token_ids) == [9]
    assert sp.seed == 7 and dict(sp.logit_bias) == {42: -100.0} and sp.no_stop_trim
    assert sp.min_new_tokens == 2 and sp.top_k == 5 and sp.HasField("ignore_eos") and not sp.ignore_eos
    assert sp.frequency_penalty == 0.5
    for unset in ("top_p", "min_p", "n", "presence_penalty", "repetition_penalty", "skip_special_tokens"):
        assert not sp.HasField(unset), unset


async def test_chat_input_conversion(stack):
    stack.fake.reset(stack.out(" Paris.", finish="stop"))
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
        {"role": "developer", "content": "dev"},
        {"role": "user", "content": [{"type": "text", "text": "What is 2+"}, {"type": "text", "text": "2?"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": stack.model, "messages": messages, "add_generation_prompt": False,
            "continue_final_message": True, "echo": True, "tools": tools, "chat_template_kwargs": {"x": 1}}
    got = (await stack.client.post(CHAT, json=body)).json()
    assert got["choices"][0]["message"]["content"] == "The capital of France is Paris."
    chat = stack.fake.requests[0].chat
    assert [m.role for m in chat.messages] == ["system", "developer", "user", "assistant", "tool", "assistant"]
    assert [p.text for p in chat.messages[2].content_parts] == ["What is 2+", "2?"]
    assert not chat.messages[2].HasField("content") and not chat.messages[3].HasField("content")
    assert chat.messages[3].tool_calls[0].function_name == "f" and chat.messages[4].tool_call_id == "c1"
    assert chat.continue_final_message
    assert chat.HasField("add_generation_prompt") and not chat.add_generation_prompt
    assert orjson.loads(chat.tools_json) == tools and orjson.loads(chat.chat_template_kwargs_json) == {"x": 1}


async def test_tool_choice_none_hides_tools(stack):
    stack.fake.reset(stack.out("ok", finish="stop"))
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {"model": stack.model, "messages": [{"role": "user", "content": "x"}], "tools": tools,
            "tool_choice": "none"}
    assert (await stack.client.post(CHAT, json=body)).status_code == 200
    chat = stack.fake.requests[0].chat
    assert chat.tools_json == "" and not chat.HasField("add_generation_prompt")


async def test_completions_non_stream_batch_n2_echo_ids(stack):
    stack.fake.reset(stack.out("!", index=0, finish="stop"), stack.out("?", index=1, finish="length"))
    body = {"model": stack.model, "prompt": [[5, 6], [7]], "n": 2, "echo": True}
    got = (await stack.client.post("/v1/completions", json=body)).json()
    assert got["object"] == "text_completion" and got["id"].startswith("cmpl-")
    assert [(c["index"], c["text"]) for c in got["choices"]] == [
        (0, "<5><6>!"), (1, "<5><6>?"), (2, "<7>!"), (3, "<7>?")]
    # two prompts of 7 tokens, four choices of 1 token
    assert got["usage"]["prompt_tokens"] == 14 and got["usage"]["completion_tokens"] == 4
    assert sorted(list(r.input_ids.ids) for r in stack.fake.requests) == [[5, 6], [7]]


async def test_native_generate_non_stream(stack):
    stack.fake.reset(stack.out("hi", finish="stop", completion=2, matched_str="."))
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "stop": "."}}
    got = (await stack.client.post("/generate", json=body)).json()
    assert got["text"] == "hi" and got["output_ids"] == [102]
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": "."}
    assert got["meta_info"]["completion_tokens"] == 2 and got["meta_info"]["prompt_tokens"] == 7
    req = stack.fake.requests[0]
    assert list(req.input_ids.ids) == [1, 2] and list(req.sampling_params.stop) == ["."]
    r = await stack.client.post("/generate", json={"text": "a", "input_ids": [1]})
    assert r.status_code == 400
    r = await stack.client.post("/generate", json={"text": "a", "sampling_params": {"max_tokens": 3}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"


async def test_models(stack):
    got = (await stack.client.get("/v1/models")).json()
    assert got["object"] == "list" and [m["id"] for m in got["data"]] == ["smol"]
    assert got["data"][0]["max_model_len"] == 2048
    assert (await stack.client.get("/v1/models/smol")).json()["id"] == "smol"
    r = await stack.client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    info = (await stack.client.get("/get_model_info")).json()
    assert info["model_path"] == "/models/SmolLM2" and info["context_length"] == 2048
    assert info["eos_token_ids"] == [] and info["served_model_name"] == "smol"


async def test_load_tokenize_detokenize_abort(stack):
    load = (await stack.client.get("/get_load")).json()
    assert sorted(load) == ["detokenizer", "scheduler", "tokenizer"]
    assert [(t["instance_id"], t["req_states"]) for t in load["tokenizer"]] == [("tok-0", 3)]
    assert [
        (s["instance_id"], s["num_running_reqs"], s["num_waiting_reqs"], s["req_slots_used"], s["kv_used_tokens"],
         s["kv_cached_tokens"])
        for s in load["scheduler"]
    ] == [("scheduler-0", 2, 1, 2, 40, 7)]
    assert [(d["instance_id"], d["decode_states"]) for d in load["detokenizer"]] == [("detokenizer-0", 2)]
    got = (await stack.client.post("/v1/tokenize", json={"prompt": "abc"})).json()
    assert got == {"tokens": [1, 2, 3], "count": 3, "max_model_len": 2048, "prompt": "abc"}
    got = (await stack.client.post("/v1/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
    assert got["prompt"].startswith("<|im_start|>user")
    assert stack.fake.tokenize_requests[-1].chat.messages[0].content == "hi"
    got = (await stack.client.post("/v1/detokenize", json={"tokens": [4, 5]})).json()
    assert got == {"prompt": "<4><5>"}
    r = await stack.client.post("/abort_request", json={"rid": "known"})
    assert r.json() == {"rid": "known", "aborted": True}
    r = await stack.client.post("/abort_request", json={"rid": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "rid"


def _with_logprobs(o):
    o.output_token_logprobs.append(-0.5)
    o.output_top_logprobs.add(token_ids=[o.output_ids[0], 7], logprobs=[-0.5, -1.0])
    return o


async def test_chat_logprobs_stream(stack):
    o = stack.out
    stack.fake.reset(_with_logprobs(o("a", completion=1)), _with_logprobs(o("b", finish="stop", completion=2)))
    body = {"model": stack.model, "messages": [{"role": "user", "content": "x"}], "stream": True,
            "logprobs": True, "top_logprobs": 2}
    raw = (await stack.client.post(CHAT, json=body)).content
    chunks = [orjson.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    content = [c["choices"][0]["logprobs"]["content"] for c in chunks]
    assert [[t["token"] for t in lp] for lp in content] == [["<101>"], ["<102>"]]
    assert content[0][0]["logprob"] == -0.5 and content[0][0]["bytes"] == list(b"<101>")
    assert [(t["token"], t["logprob"]) for t in content[1][0]["top_logprobs"]] == [("<102>", -0.5), ("<7>", -1.0)]
    req = stack.fake.requests[0]
    assert req.return_logprob and req.top_logprobs_num == 2


async def test_completions_logprobs_text_offset(stack):
    stack.fake.reset(_with_logprobs(stack.out("a", finish="stop", completion=1)))
    body = {"model": stack.model, "prompt": "xyz", "echo": True, "logprobs": 1}
    lp = (await stack.client.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
    assert lp == {"tokens": ["<101>"], "token_logprobs": [-0.5], "top_logprobs": [{"<101>": -0.5, "<7>": -1.0}],
                  "text_offset": [3]}
