"""Stop decisions: stop token ids, stop strings across token boundaries, length, EOS, min tokens."""

from __future__ import annotations

import pytest

from services.scheduler.engine.req import FinishType


@pytest.fixture(scope="module")
def story(make_engine, chat_ids, greedy_req, run_all):
    """A 24-token greedy continuation with ignore_eos: the reference the stops cut."""
    prompt = chat_ids("Write a short poem about rivers.")
    engine = make_engine()
    engine.add_request(greedy_req("ref", prompt, 24, ignore_eos=True))
    return prompt, run_all(engine)["ref"].output_ids


def run_one(make_engine, run_all, req):
    engine = make_engine()
    engine.add_request(req)
    result = run_all(engine)[req.rid]
    assert (engine.load().kv_used_tokens, engine.load().req_slots_used) == (0, 0)
    return result


def test_stop_token_id(make_engine, run_all, greedy_req, story):
    prompt, ref = story
    stop_id = ref[5]
    first = ref.index(stop_id)
    res = run_one(make_engine, run_all, greedy_req("s", prompt, 24, ignore_eos=True, stop_token_ids=frozenset({stop_id})))
    assert res.finish.type == FinishType.STOP and res.finish.matched_token_id == stop_id
    assert res.output_ids == ref[: first + 1] and res.completion_tokens == first + 1


def test_stop_string_across_token_boundary(make_engine, run_all, greedy_req, tokenizer, story):
    prompt, ref = story
    # Find tokens k, k+1 with >= 2 visible characters each; the stop ends inside token k+1.
    k = next(i for i in range(3, len(ref) - 1)
             if len(tokenizer.decode([ref[i]]).strip()) >= 2 and len(tokenizer.decode([ref[i + 1]]).strip()) >= 2)
    left, right = tokenizer.decode([ref[k]]), tokenizer.decode([ref[k + 1]])
    stop = left[-2:] + right[:2]
    text_before = tokenizer.decode(ref[:k + 1])
    assert stop not in text_before[:-2]  # its first occurrence is the one spanning k | k+1
    res = run_one(make_engine, run_all, greedy_req("s", prompt, 24, ignore_eos=True, stop=(stop, "never-seen-xyz")))
    assert res.finish.type == FinishType.STOP and res.finish.matched_str == stop
    assert res.output_ids == ref[: k + 2] and res.completion_tokens == k + 2


def test_max_new_tokens_is_length(make_engine, run_all, greedy_req, story):
    prompt, ref = story
    res = run_one(make_engine, run_all, greedy_req("s", prompt, 7, ignore_eos=True))
    assert res.finish.type == FinishType.LENGTH and res.finish.matched_str is None
    assert res.completion_tokens == 7 and res.output_ids == ref[:7] and res.rows == 7


def test_eos_and_ignore_eos_and_min_tokens(make_engine, run_all, greedy_req, chat_ids):
    prompt = chat_ids("Say hi.")
    res = run_one(make_engine, run_all, greedy_req("s", prompt, 64))
    assert res.finish.type == FinishType.STOP and res.finish.matched_token_id == 2  # <|im_end|>
    n = res.completion_tokens
    assert n < 64 and res.output_ids[-1] == 2 and 2 not in res.output_ids[:-1]
    ignored = run_one(make_engine, run_all, greedy_req("s", prompt, n + 5, ignore_eos=True))
    assert ignored.finish.type == FinishType.LENGTH and ignored.output_ids[:n] == res.output_ids
    held = run_one(make_engine, run_all, greedy_req("s", prompt, n + 6, min_new_tokens=n + 3))
    assert 2 not in held.output_ids[: n + 3] and held.completion_tokens >= n + 3
