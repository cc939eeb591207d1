"""TokenizerManager without a network: tokenization, rids, n > 1, ReqState life cycle, coalescing."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from ringserve.v1 import common_pb2, detokenizer_pb2, tokenizer_pb2
from services.tokenizer.errors import RequestError, unavailable

REPO = Path(__file__).resolve().parents[2]
STOP = common_pb2.FinishReason(type=common_pb2.FINISH_STOP, matched_token_id=2)
LENGTH = common_pb2.FinishReason(type=common_pb2.FINISH_LENGTH)
ABORT = common_pb2.FinishReason(type=common_pb2.FINISH_ABORT, status="CANCELLED", message="aborted")


def batch(*rows: tuple) -> detokenizer_pb2.BatchStrOutput:
    """rows: (rid, text, ids, finish_reason or None, completion_tokens)."""
    out = detokenizer_pb2.BatchStrOutput()
    for rid, text, ids, finish, completion in rows:
        out.rids.append(rid)
        out.texts.append(text)
        out.new_token_counts.append(len(ids))
        out.output_ids.extend(ids)
        out.finish_reasons.append(finish or common_pb2.FinishReason())
        out.prompt_tokens.append(0)
        out.completion_tokens.append(completion)
        out.cached_tokens.append(3)
    return out


def text_req(rid: str = "r1", stream: bool = True, **sp) -> tokenizer_pb2.GenerateReqInput:
    return tokenizer_pb2.GenerateReqInput(
        rid=rid, text="Hello there", stream=stream, sampling_params=common_pb2.SamplingParams(**sp)
    )


async def settle() -> None:
    """Let every ready task run (consumers wrapped in wait_for take more than one loop turn)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def next_out(gen) -> tokenizer_pb2.GenerateOutput:
    return await asyncio.wait_for(gen.__anext__(), 5)


def test_tokenizer_service_never_imports_torch(smollm2_dir):
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from services.tokenizer.main import TokenizerService, TokenizerConfig\n"
        "from ringserve.v1 import tokenizer_pb2\n"
        f"s = TokenizerService(TokenizerConfig(model=Path({str(smollm2_dir)!r}), port=0))\n"
        "m = s.manager\n"
        "chat = tokenizer_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role='user', content='hi')])\n"
        "m.prepare(tokenizer_pb2.GenerateReqInput(chat=chat))\n"
        "m.detokenize(tokenizer_pb2.DetokenizeRequest(ids=[28120, 905]))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"


def test_model_info(manager, smollm2_dir):
    info = manager.model_info()
    assert info.served_model_name == "SmolLM2-135M-Instruct"
    assert (info.context_length, info.vocab_size, info.has_chat_template) == (8192, 49152, True)
    assert list(info.eos_token_ids) == [2]
    assert info.model_path == str(smollm2_dir)


def test_text_is_tokenized_with_the_default_special_tokens(manager):
    p = manager.prepare(text_req())
    assert list(p.subs[0].input_ids) == manager.tokenizer.encode("Hello there")
    assert p.subs[0].sampling_params.max_new_tokens == 8192 - p.prompt_len
    assert (p.subs[0].rid, p.subs[0].tokenizer_id, p.subs[0].stream) == ("r1", "tok-test", True)


def test_chat_is_tokenized_from_the_rendered_prompt(manager):
    chat = tokenizer_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="user", content="hi")])
    p = manager.prepare(tokenizer_pb2.GenerateReqInput(chat=chat))
    assert p.prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert list(p.subs[0].input_ids) == manager.tokenizer.encode(p.prompt, add_special_tokens=False)
    assert len(p.rid) == 32 and int(p.rid, 16) >= 0  # uuid4 hex made for an empty rid


def test_a_constraint_after_reasoning_gets_its_start_tag_as_token_ids(manager):
    req = text_req()
    req.sampling_params.constraint.CopyFrom(common_pb2.Constraint(regex="[0-9]+", starts_after="</think>"))
    sub = manager.prepare(req).subs[0]
    c = sub.sampling_params.constraint
    assert (c.regex, c.starts_after) == ("[0-9]+", "</think>")
    assert list(c.starts_after_ids) == manager.tokenizer.encode("</think>", add_special_tokens=False)
    assert len(c.starts_after_ids) > 1  # SmolLM2 spells the tag in several tokens
    plain = text_req()
    plain.sampling_params.constraint.CopyFrom(common_pb2.Constraint(regex="[0-9]+"))
    assert list(manager.prepare(plain).subs[0].sampling_params.constraint.starts_after_ids) == []


def test_a_prompt_that_opens_the_reasoning_is_marked_and_clears_the_opening_tag(manager):
    def chat_req(*messages) -> tokenizer_pb2.GenerateReqInput:
        cont = messages[-1][0] == "assistant"
        chat = tokenizer_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role=r, content=t) for r, t in messages],
                                       continue_final_message=cont, add_generation_prompt=not cont,
                                       reasoning_start="<think>")
        req = tokenizer_pb2.GenerateReqInput(chat=chat)
        req.sampling_params.constraint.CopyFrom(common_pb2.Constraint(regex="[0-9]+", starts_after="</think>",
                                                                      opens_with="<think>"))
        return req

    opened = manager.prepare(chat_req(("user", "hi"), ("assistant", "<think>\n")))
    closed = manager.prepare(chat_req(("user", "hi")))
    assert (opened.reasoning_open, closed.reasoning_open) == (True, False)
    think = manager.tokenizer.encode("<think>", add_special_tokens=False)
    assert list(opened.subs[0].sampling_params.constraint.opens_with_ids) == []  # reasoning from the first token
    assert list(closed.subs[0].sampling_params.constraint.opens_with_ids) == think
    (st,) = manager.register(opened)
    assert st.reasoning_open
    manager.release([st], "test")


def test_input_ids_are_taken_as_they_are_and_checked(manager):
    p = manager.prepare(tokenizer_pb2.GenerateReqInput(input_ids=tokenizer_pb2.TokenIds(ids=[1, 49151, 0])))
    assert list(p.subs[0].input_ids) == [1, 49151, 0]
    for ids, message in (([], "input_ids must not be empty"),
                         ([5, 49152], "input_ids: token id 49152 is outside the vocabulary [0, 49152)"),
                         ([-1], "input_ids: token id -1 is outside the vocabulary [0, 49152)")):
        with pytest.raises(RequestError) as info:
            manager.prepare(tokenizer_pb2.GenerateReqInput(input_ids=tokenizer_pb2.TokenIds(ids=ids)))
        assert (info.value.status, info.value.message) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    with pytest.raises(RequestError) as info:
        manager.prepare(tokenizer_pb2.GenerateReqInput())
    assert info.value.message == "one of text, input_ids or chat is required"


def test_n_expands_into_sub_requests_sharing_the_prompt(manager):
    p = manager.prepare(text_req("abc", n=3, seed=10, temperature=0.7))
    assert [s.rid for s in p.subs] == ["abc-0", "abc-1", "abc-2"]
    assert [s.sampling_params.seed for s in p.subs] == [10, 11, 12]
    assert all(list(s.input_ids) == list(p.subs[0].input_ids) for s in p.subs)
    unseeded = manager.prepare(text_req("abc", n=2))
    assert not any(s.sampling_params.HasField("seed") for s in unseeded.subs)
    wrap = manager.prepare(text_req("w", n=2, seed=2**64 - 1))
    assert [s.sampling_params.seed for s in wrap.subs] == [2**64 - 1, 0]


async def test_stream_life_cycle(manager, dispatcher):
    gen = manager.generate(text_req("r1", stream=True))
    task = asyncio.ensure_future(next_out(gen))
    await settle()
    assert [r.rid for r in dispatcher.reqs] == ["r1"]
    st = manager.rid_to_state["r1"]
    assert (st.dispatched, st.abort_sent, st.finished) == (True, False, False)
    manager.handle_batch(batch(("r1", "Hi", [11], None, 1)))
    first = await task
    assert (first.rid, first.text, list(first.output_ids), first.finish_reason.type) == (
        "r1", "Hi", [11], common_pb2.FINISH_NONE)
    assert (first.prompt_tokens, first.completion_tokens, first.cached_tokens) == (
        len(dispatcher.reqs[0].input_ids), 1, 3)
    manager.handle_batch(batch(("r1", " there", [12], STOP, 2)))
    last = await next_out(gen)
    assert (last.text, list(last.output_ids), last.finish_reason.matched_token_id) == (" there", [12], 2)
    assert manager.load().req_states == 1  # deleted once the final output is delivered
    with pytest.raises(StopAsyncIteration):
        await next_out(gen)
    assert manager.load().req_states == 0 and not dispatcher.aborts


async def test_queued_rows_are_coalesced_into_one_delta(manager):
    gen = manager.generate(text_req("r1", stream=True))
    task = asyncio.ensure_future(next_out(gen))
    await settle()
    manager.handle_batch(batch(("r1", "a", [1], None, 1)))
    manager.handle_batch(batch(("r1", "b", [2], None, 2)))
    manager.handle_batch(batch(("r1", "c", [3], LENGTH, 3)))
    out = await task
    assert (out.text, list(out.output_ids), out.completion_tokens, out.finish_reason.type) == (
        "abc", [1, 2, 3], 3, common_pb2.FINISH_LENGTH)
    assert [o async for o in gen] == []
    assert manager.load().req_states == 0


async def test_non_stream_gives_one_final_output_per_choice(manager, dispatcher):
    gen = manager.generate(text_req("r", stream=False, n=2))
    task = asyncio.ensure_future(next_out(gen))
    await settle()
    assert [r.rid for r in dispatcher.reqs] == ["r-0", "r-1"]
    manager.handle_batch(batch(("r-0", "x", [5], None, 1), ("r-1", "p", [7], None, 1)))
    await settle()
    assert not task.done()  # nothing is sent before a choice finishes
    manager.handle_batch(batch(("r-1", "q", [8], STOP, 2)))
    first = await task
    assert (first.rid, first.index, first.text, list(first.output_ids), first.completion_tokens) == (
        "r", 1, "pq", [7, 8], 2)
    manager.handle_batch(batch(("r-0", "y", [6], None, 2)))
    await settle()
    manager.handle_batch(batch(("r-0", "z", [9], LENGTH, 3)))
    second = await next_out(gen)
    assert (second.index, second.text, list(second.output_ids), second.completion_tokens) == (0, "xyz", [5, 6, 9], 3)
    assert second.finish_reason.type == common_pb2.FINISH_LENGTH
    with pytest.raises(StopAsyncIteration):
        await next_out(gen)
    assert manager.load().req_states == 0


async def test_duplicate_rid_is_rejected_before_dispatch(manager, dispatcher):
    gen = manager.generate(text_req("dup"))
    task = asyncio.ensure_future(next_out(gen))
    await settle()
    for again in (text_req("dup"), text_req("dup", n=2)):
        with pytest.raises(RequestError) as info:
            await next_out(manager.generate(again))
        assert (info.value.status, info.value.message) == (
            grpc.StatusCode.ALREADY_EXISTS, "request id 'dup' is already in flight")
    gen2 = manager.generate(text_req("x", n=2))
    t2 = asyncio.ensure_future(next_out(gen2))
    await settle()
    with pytest.raises(RequestError) as info:
        await next_out(manager.generate(text_req("x-1")))
    assert info.value.code == "duplicate_request_id"
    assert [r.rid for r in dispatcher.reqs] == ["dup", "x-0", "x-1"]  # nothing more was dispatched
    assert set(manager.rid_to_state) == {"dup", "x-0", "x-1"}  # the first requests are untouched
    manager.handle_batch(batch(("dup", "ok", [1], STOP, 1)))
    assert (await task).text == "ok"
    t2.cancel()
    await asyncio.gather(t2, return_exceptions=True)
    await gen.aclose()
    await gen2.aclose()


async def test_cancel_sends_abort_and_keeps_state_until_the_abort_row(manager, dispatcher):
    gen = manager.generate(text_req("c", n=2))

    async def consume():
        async for _ in gen:
            pass

    task = asyncio.ensure_future(consume())
    await settle()
    manager.handle_batch(batch(("c-0", "a", [1], None, 1), ("c-1", "b", [2], STOP, 1)))
    await settle()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert [(a.rid, a.tokenizer_id) for a in dispatcher.aborts] == [("c-0", "tok-test")]  # c-1 had finished
    st = manager.rid_to_state["c-0"]
    assert (st.abort_sent, st.detached) == (True, True)
    assert manager.load().req_states == 1
    manager.handle_batch(batch(("c-0", "late", [3], None, 2)))
    assert manager.load().req_states == 1
    manager.handle_batch(batch(("c-0", "", [], ABORT, 2)))
    assert manager.load().req_states == 0
    await manager.generate(text_req("c", n=2)).aclose()  # the rid is free again


async def test_closing_the_generator_aborts_like_a_cancel(manager, dispatcher):
    gen = manager.generate(text_req("g"))
    task = asyncio.ensure_future(next_out(gen))
    await settle()
    manager.handle_batch(batch(("g", "a", [1], None, 1)))
    await task
    await gen.aclose()
    assert [a.rid for a in dispatcher.aborts] == ["g"]
    manager.handle_batch(batch(("g", "", [], ABORT, 1)))
    assert manager.load().req_states == 0


async def test_scheduler_down_fails_before_dispatch_and_drops_state(manager, dispatcher):
    dispatcher.down = True
    with pytest.raises(RequestError) as info:
        await next_out(manager.generate(text_req("u")))
    assert info.value.status == grpc.StatusCode.UNAVAILABLE
    assert manager.load().req_states == 0


async def test_lost_link_fails_in_flight_calls(manager, dispatcher):
    gen = manager.generate(text_req("l", n=2))
    task = asyncio.ensure_future(next_out(gen))
    await settle()
    assert manager.fail_all(unavailable("lost the connection to the detokenizer"), send_aborts=True) == 2
    with pytest.raises(RequestError) as info:
        await task
    assert (info.value.status, info.value.message) == (
        grpc.StatusCode.UNAVAILABLE, "lost the connection to the detokenizer")
    assert sorted(a.rid for a in dispatcher.aborts) == ["l-0", "l-1"]
    assert manager.load().req_states == 0


async def test_scheduler_invalid_argument_abort_ends_the_call_with_that_status(manager, dispatcher):
    gen = manager.generate(text_req("e", n=2))
    task = asyncio.ensure_future(next_out(gen))
    await settle()
    bad = common_pb2.FinishReason(type=common_pb2.FINISH_ABORT, status="INVALID_ARGUMENT",
                                  message="stop string too long")
    manager.handle_batch(batch(("e-1", "", [], bad, 0)))
    with pytest.raises(RequestError) as info:
        await task
    assert (info.value.status, info.value.message) == (grpc.StatusCode.INVALID_ARGUMENT, "stop string too long")
    # e-1: in case the error came from the detokenizer while the scheduler still runs it; e-0: the call ended
    assert [a.rid for a in dispatcher.aborts] == ["e-1", "e-0"]
    manager.handle_batch(batch(("e-0", "", [], ABORT, 0)))
    assert manager.load().req_states == 0


async def test_abort_rpc_aborts_every_choice_and_the_call_sees_finish_abort(manager, dispatcher):
    gen = manager.generate(text_req("a", n=2))
    task = asyncio.ensure_future(next_out(gen))
    await settle()
    assert manager.abort("a") is True
    assert manager.abort("nope") is False
    assert sorted(a.rid for a in dispatcher.aborts) == ["a-0", "a-1"]
    manager.handle_batch(batch(("a-0", "", [], ABORT, 0), ("a-1", "", [], ABORT, 0)))
    outs = [await task, await next_out(gen)]
    assert sorted((o.index, o.finish_reason.type) for o in outs) == [
        (0, common_pb2.FINISH_ABORT), (1, common_pb2.FINISH_ABORT)]
    with pytest.raises(StopAsyncIteration):
        await next_out(gen)
    assert len(dispatcher.aborts) == 2 and manager.load().req_states == 0


def test_logprob_columns_are_split_per_row(manager):
    from services.tokenizer.state import split_rows

    b = batch(("x", "ab", [1, 2], None, 2), ("y", "c", [3], None, 1))
    b.logprob_counts.extend([2, 0])
    b.output_token_logprobs.extend([-0.5, -1.5])
    b.top_logprobs_nums.extend([2, 0])
    b.top_logprob_ids.extend([1, 9, 2, 8])
    b.top_logprob_vals.extend([-0.5, -2.0, -1.5, -3.0])
    x, y = split_rows(b)
    assert (x.output_ids, x.logprobs, y.output_ids, y.logprobs) == ([1, 2], [-0.5, -1.5], [3], [])
    assert [(list(t.token_ids), list(t.logprobs)) for t in x.top_logprobs] == [
        ([1, 9], [-0.5, -2.0]), ([2, 8], [-1.5, -3.0])]
    assert y.top_logprobs == []


async def test_requests_are_refused_while_outputs_cannot_arrive(manager, dispatcher):
    manager.outputs_up = False
    with pytest.raises(RequestError) as info:
        await next_out(manager.generate(text_req("o")))
    assert (info.value.status, info.value.message) == (
        grpc.StatusCode.UNAVAILABLE, "the detokenizer subscription is down")
    assert dispatcher.reqs == [] and manager.load().req_states == 0
