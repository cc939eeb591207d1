"""xgrammar against llguidance on the same constraints and SmolLM2's vocabulary, side by side.

For each constraint: compile time (cold, no cache), then the per-token cost of computing
the next-token bitmask and advancing the matcher, over a fixed valid output (the same
token ids for both engines). Prints one table; the figures are recorded in bench/RESULTS.md.

    .venv/bin/python bench/grammar_backends.py [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from ringserve.models import DEFAULT_CACHE


def nested_one_of(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for i in range(depth):
        schema = {"oneOf": [{"type": "object", "properties": {f"k{i}": schema}, "required": [f"k{i}"]},
                            {"type": "array", "items": schema}]}
    return schema


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "address": {"$ref": "#/$defs/address"},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
    "$defs": {"address": {"type": "object",
                          "properties": {"city": {"type": "string"},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                          "required": ["city", "zip"], "additionalProperties": False}},
}
CASES = [
    ("json_object", "json", {"type": "object"},
     '{"answer": 19, "words": ["nine", "teen"], "ok": true}'),
    ("schema S06", "json", {"type": "object",
                            "properties": {"guard": {"const": "SCHEMA_ENFORCED"}, "answer": {"type": "integer"}},
                            "required": ["guard", "answer"], "additionalProperties": False},
     '{"guard": "SCHEMA_ENFORCED", "answer": 23}'),
    ("schema person ($ref, enum, pattern)", "json", PERSON,
     '{"name": "Ada", "age": 36, "tags": ["a", "c"], "address": {"city": "London", "zip": "12345"}}'),
    ("regex IPv4", "regex", r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)", "192.168.100.254"),
    ("nested oneOf depth 6", "json", nested_one_of(6), '{"k5": [{"k3": [{"k1": [7]}]}]}'),
]


def compile_xgr(compiler, kind, spec):
    if kind == "regex":
        return compiler.compile_regex(spec)
    return compiler.compile_json_schema(json.dumps(spec), strict_mode=False, max_whitespace_cnt=4)


def run_xgr(compiled, ids, vocab):
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        assert m.accept_token(t), t
        times.append(time.perf_counter() - t0)
    return times


def ll_grammar(kind, spec):
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec), options)


def run_ll(ll_tok, grammar, ids, vocab):
    m = llguidance.LLMatcher(ll_tok, grammar)
    assert not m.is_error(), m.get_error()
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(m, mask, 0)
        assert m.consume_token(t), (t, m.get_error())
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    model = args.model or DEFAULT_CACHE / "models" / "SmolLM2-135M-Instruct"
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    xgr_tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
    ll_tok_s = time.perf_counter() - t0
    print(f"tokenizer set-up: xgrammar {xgr_tok_s * 1e3:.0f} ms, llguidance {ll_tok_s * 1e3:.0f} ms (vocab {vocab})")
    print(f"{'constraint':38} {'xgr compile':>11} {'xgr mask/tok':>12} {'llg compile':>11} {'llg mask/tok':>12}")
    for name, kind, spec, text in CASES:
        ids = hf.encode(text, add_special_tokens=False) + [eos]
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compile_xgr(compiler, kind, spec)
        xc = time.perf_counter() - t0
        xt = run_xgr(compiled, ids, vocab)
        t0 = time.perf_counter()
        grammar = ll_grammar(kind, spec)
        lt_first = run_ll(ll_tok, grammar, ids[:1], vocab)
        lc = time.perf_counter() - t0 - sum(lt_first)
        lt = run_ll(ll_tok, grammar, ids, vocab)
        print(f"{name:38} {xc * 1e3:9.1f}ms {statistics.median(xt) * 1e6:9.0f}us "
              f"{lc * 1e3:9.1f}ms {statistics.median(lt) * 1e6:9.0f}us"
              f"   (p99 xgr {max(xt) * 1e6:.0f}us, llg {max(lt) * 1e6:.0f}us over {len(ids)} tokens)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
