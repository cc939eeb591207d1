"""Stop decisions: stop token ids, stop strings across token boundaries, length, EOS, min tokens."""

from __future__ import annotations

import pytest

from services.scheduler.policy.req import FinishReason, FinishType, Req, ReqInput, SamplingParams
from services.scheduler.policy.stops import StopChecker


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
    req = greedy_req("s", prompt, 24, ignore_eos=True, stop_token_ids=frozenset({stop_id}))
    res = run_one(make_engine, run_all, req)
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


def feed_until_finished(checker, tokenizer, text: str, **sampling) -> tuple[Req, int]:
    """Append ``text``'s ids one at a time, checking after each; (req, tokens appended)."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    req = Req(ReqInput(rid="r", input_ids=[1], sampling=SamplingParams(max_new_tokens=len(ids) + 1, **sampling)))
    for n, token in enumerate(ids, 1):
        req.append_output(token)
        checker.check([req])
        if req.finished:
            return req, n
    return req, len(ids)


@pytest.fixture(scope="module")
def checker(tokenizer):
    return StopChecker(tokenizer, frozenset({2}), context_length=8192)


def test_stop_string_of_multi_token_characters(checker, tokenizer):
    # 12 CJK characters take ~28 byte-level tokens: a window counted in characters misses it.
    stop = "社区非常活跃社区非常活跃"
    text = "前言：" + stop + "。后记"
    req, n = feed_until_finished(checker, tokenizer, text, stop=(stop,))
    assert req.finish_reason == FinishReason(FinishType.STOP, matched_str=stop)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert n == next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))


def test_stop_string_before_min_tokens_is_not_matched_later(checker, tokenizer):
    # " 4" appears at the first token, below min_new_tokens: it is not a stop then, and it
    # must not end the request later either; the next occurrence does.
    text = " 4 5 6 7 8 9 4 5"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    req, n = feed_until_finished(checker, tokenizer, text, stop=(" 4",), min_new_tokens=3)
    assert req.finish_reason == FinishReason(FinishType.STOP, matched_str=" 4")
    assert tokenizer.decode(ids[:n]) == " 4 5 6 7 8 9 4"


def test_stop_string_earliest_new_occurrence_wins(checker, tokenizer):
    # Both stops complete at " world"; "lo wor" starts first in the text.
    req, _ = feed_until_finished(checker, tokenizer, "Hello world again", stop=("world", "lo wor"))
    assert req.finish_reason == FinishReason(FinishType.STOP, matched_str="lo wor")
