"""int8 weights (``--quantization int8|int8wo``, ``layers.quant``): the kernels against a
torch emulation, bit for bit where the arithmetic allows; batch invariance; the refusals;
and the quality gate on 20,000 tokens of text shipped with Python (its licence and the
language reference's topics in ``pydoc_data``): int8 perplexity within 2 % of bf16's and
greedy next-token agreement with bf16 of at least 97 %, or bf16 stays the default.

Measured (``bench/int8_quality.py``, bench/RESULTS.md): weight-only int8 (``int8wo``)
passes the perplexity half (+0.8 %) and agrees on 95 % of the tokens; fp32 weights agree
with bf16 on only 97.8 % (bf16 logits tie, and any other rounding breaks the ties
differently), so the 97 % half is within 3 points of the metric's own noise and int8 misses
it. The test holds both halves, the rule (default bf16 while the gate fails) and a floor of
94 % under which a kernel change would be a regression, not noise."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ringserve.bench.corpus import python_docs_text
from services.scheduler.config import EngineConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.executor.build import apply_quantization
from services.scheduler.layers import quant
from services.scheduler.layers.cpu_linear import CpuLinear, amx_bf16_available
from services.scheduler.layers.quant import (
    Int8Linear,
    QuantizationError,
    check_supported,
    dequantize,
    quantize_weight,
    unpack,
)
from services.scheduler.main import parse_args
from services.scheduler.models import load_model
from services.scheduler.policy.req import ReqInput, SamplingParams

CORPUS_TOKENS = 20_000
WINDOW = 1_000  # tokens a request scores (its first has no prediction): 20 windows

# The kernels are AVX-512-VNNI code: on a CPU without it int8 is refused (the tests of the
# refusal below run everywhere) and the tests that run the kernels cannot.
needs_vnni = pytest.mark.skipif(not quant.cpu_runs_int8(), reason="this CPU has no AVX-512-VNNI: int8 is refused here")


def emulate_w8a8(x: torch.Tensor, linear: Int8Linear) -> torch.Tensor:
    """What the W8A8 kernel computes, in torch, op for op in fp32 (the int32 sum exact in int64)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    # a true division (``127.0 / amax`` is reciprocal-then-multiply in torch: 1 ulp off)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    q = torch.round(xf * inv[:, None]).to(torch.int64)  # half to even, as vcvtps2dq
    xs = amax / 127.0
    n, k = linear.out_features, linear.in_features
    w = unpack(linear.packed)[:n, :k].to(torch.int64)
    acc = (q @ w.T).to(torch.float32)
    y = acc * linear.scale[:n] * xs[:, None]
    if linear.bias is not None:
        y = y + linear.bias
    return y.to(x.dtype)


@pytest.fixture(scope="module")
def linear() -> Int8Linear:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 300, generator=g) * 0.05  # N = 200: not a multiple of 16 (nor of 64)
    weight[7] = 0.0  # an all-zero channel: scale 0
    return Int8Linear(weight, torch.randn(200, generator=g))


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_w8a8_kernel_equals_its_emulation_bit_for_bit(linear, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 300, generator=g) * 3).to(dtype)
    x[5] = 0.0  # an all-zero row: scale 0, output the bias
    out = linear(x, "w8a8")
    assert out.dtype == dtype and out.shape == (37, 200)
    assert torch.equal(out, emulate_w8a8(x, linear))
    assert torch.equal(out[5], linear.bias.to(dtype))


def test_quantize_weight_round_trip_and_padding():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(33, 10, generator=g)
    packed, scale, comp = quantize_weight(w)
    assert packed.shape == (1, 3, 4, 16, 4) and packed.dtype == torch.int8  # N 33 -> 64, K 10 -> 12
    assert scale.shape == (64,) and torch.equal(scale[33:], torch.zeros(31))
    assert torch.equal(unpack(packed)[33:], torch.zeros(31, 12, dtype=torch.int8))
    back = dequantize(packed, scale, 33, 10)
    assert torch.all((back - w).abs() <= scale[:33, None] / 2 + 1e-7)  # round to nearest: half a step
    q = torch.round(back / torch.where(scale[:33] > 0, scale[:33], 1)[:, None])
    assert torch.equal(comp[:33], (q.sum(dim=1) * 128).to(torch.int32))
    assert q.abs().max().item() == 127  # each channel's largest weight maps to +-127


@needs_vnni
def test_weight_only_kernel_matches_float64_reference(linear):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 300, generator=g)
    out = linear(x, "w8")
    ref = (x.double() @ dequantize(linear.packed, linear.scale, 200, 300).double().T + linear.bias.double())
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)


@needs_vnni
def test_weight_only_kernels_give_each_others_bits(linear):
    # w8 sums in vdpbf16ps's order (k+1, then k, per pair), one FMA chain an output
    g = torch.Generator().manual_seed(5)
    assert linear.can_run("w8bf16", torch.bfloat16) and not linear.can_run("w8bf16", torch.float32)
    for rows in (1, 2, 3, 20):
        x = torch.randn(rows, 300, generator=g).bfloat16()
        assert torch.equal(linear(x, "w8"), linear(x, "w8bf16"))


@pytest.mark.skipif(not (quant.cpu_runs_int8() and quant.lib().rs_w8_amx_available()),
                    reason="this CPU (or kernel) has no AMX-BF16: int8wo runs the AVX-512 kernels here")
def test_amx_kernel_matches_float64_reference_and_a_rows_bits_do_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(6)
    linear = Int8Linear(torch.randn(200, 320, generator=g) * 0.05, torch.randn(200, generator=g))  # K: 10 x 32
    assert linear.can_run("w8amx", torch.bfloat16) and not linear.can_run("w8amx", torch.float32)
    x = torch.randn(37, 320, generator=g).bfloat16()  # 3 row tiles, the last of 5 rows
    batched = linear(x, "w8amx")
    ref = x.double() @ dequantize(linear.packed, linear.scale, 200, 320).double().T + linear.bias.double()
    assert torch.allclose(batched.double(), ref, rtol=2 ** -8, atol=1e-3)  # the bf16 output's rounding
    for i in (0, 1, 15, 16, 17, 36):
        assert torch.equal(linear(x[i : i + 1], "w8amx"), batched[i : i + 1])
    assert torch.equal(linear(x[15:33], "w8amx"), batched[15:33])


@needs_vnni
def test_fix_kernels_pins_only_a_mix_of_kernel_families(linear):
    model = torch.nn.Sequential(linear)
    try:
        linear.kernels = ((1, "w8"), (16, "w8bf16"))
        assert quant.fix_kernels(model) == 0 and linear.kernels == ((1, "w8"), (16, "w8bf16"))
        linear.kernels = ((1, "w8"), (4, "w8"), (16, "w8a8"), (64, "w8a8"))
        assert quant.fix_kernels(model) == 1 and linear.kernels == ((1, "w8"),)  # a tie: the fewest rows' kernel
        linear.kernels = ((1, "w8"), (4, "w8amx"), (16, "w8amx"), (64, "w8bf16"))  # AMX: other bits than w8's
        assert quant.fix_kernels(model) == 1 and linear.kernels == ((1, "w8amx"),)
        # with timings: the family whose worst bucket loses least (w8amx: 2x at 1 row; w8: 6x at 64)
        linear.timings = {1: {"w8": 0.15, "w8bf16": 0.33, "w8amx": 0.3}, 4: {"w8": 0.26, "w8bf16": 0.7, "w8amx": 0.3},
                          16: {"w8": 0.87, "w8bf16": 0.84, "w8amx": 0.38},
                          64: {"w8": 3.0, "w8bf16": 2.6, "w8amx": 0.5}}
        linear.kernels = ((1, "w8"), (4, "w8"), (16, "w8amx"), (64, "w8amx"))
        assert quant.fix_kernels(model) == 1 and linear.kernels == ((1, "w8amx"),)
        linear.timings[16]["w8bf16"], linear.timings[64]["w8bf16"] = 0.4, 0.55  # now AMX's 2x is the worst loss
        linear.kernels = ((1, "w8"), (4, "w8"), (16, "w8amx"), (64, "w8amx"))
        assert quant.fix_kernels(model) == 1
        assert linear.kernels == ((1, "w8"), (4, "w8"), (16, "w8bf16"), (64, "w8bf16"))
    finally:
        linear.kernels, linear.timings = ((1, "w8a8"),), {}


@pytest.mark.skipif(not (quant.cpu_runs_int8() and quant.lib().rs_w8a8_amx_available()),
                    reason="this CPU (or kernel) has no AMX-INT8: w8a8 runs the AVX-512 tiles at every row count")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_w8a8_on_amx_tiles_gives_the_emulations_bits_at_every_row_count(dtype):
    """From 8 rows W8A8 runs on AMX-INT8 tiles where K is a multiple of 64: the same exact int32
    sums as the AVX-512 tiles below 8 rows, so every row count gives the emulation's bits (N = 200:
    an odd block count, the last block part-filled; 37 rows: a part-filled row tile)."""
    g = torch.Generator().manual_seed(7)
    linear = Int8Linear(torch.randn(200, 192, generator=g) * 0.05, torch.randn(200, generator=g))
    x = (torch.randn(70, 192, generator=g) * 3).to(dtype)
    x[40] = 0.0
    for rows in (1, 7, 8, 16, 17, 37, 64, 70):
        assert torch.equal(linear(x[:rows], "w8a8"), emulate_w8a8(x[:rows], linear)), rows


@needs_vnni
@pytest.mark.parametrize("kernel", ["w8a8", "w8", "w8bf16"])
def test_a_rows_bits_do_not_depend_on_its_batch(linear, kernel):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 300, generator=g).bfloat16()
    batched = linear(x, kernel)
    for i in (0, 1, 2, 3, 4, 5, 63):
        assert torch.equal(linear(x[i : i + 1], kernel), batched[i : i + 1])
    assert torch.equal(linear(x[3:9], kernel), batched[3:9])


def test_refusals_name_what_is_wrong(monkeypatch):
    with pytest.raises(QuantizationError, match="unknown --quantization 'fp8'; supported: int8"):
        check_supported("fp8", torch.device("cpu"))
    with pytest.raises(QuantizationError, match="runs on the CPU only .* not on cuda:0"):
        check_supported("int8", torch.device("cuda:0"))
    monkeypatch.setattr(quant, "cpu_flags", lambda: "flags : fpu avx2 avx512f")
    with pytest.raises(QuantizationError, match="needs a CPU with AVX-512-VNNI"):
        check_supported("int8", torch.device("cpu"))


def test_this_cpu_runs_int8_exactly_when_it_has_vnni():
    """On the CPU the suite runs on: int8 is offered with AVX-512-VNNI and refused, by name,
    without it (never a kernel that aborts the process)."""
    vnni = "avx512_vnni" in quant.cpu_flags().split()
    assert quant.cpu_runs_int8() == vnni
    if vnni:
        check_supported("int8", torch.device("cpu"))
        assert Int8Linear(torch.ones(64, 64), None)(torch.ones(1, 64)).shape == (1, 64)
    else:
        with pytest.raises(QuantizationError, match="needs a CPU with AVX-512-VNNI"):
            check_supported("int8", torch.device("cpu"))
        with pytest.raises(QuantizationError, match="Int8Linear needs a CPU with AVX-512-VNNI"):
            Int8Linear(torch.ones(64, 64), None)


def test_scheduler_flag(capsys, monkeypatch, smollm2_dir):
    if quant.cpu_runs_int8():
        assert parse_args(["--model", str(smollm2_dir), "--quantization", "int8"]).engine.quantization == "int8"
    assert parse_args(["--model", str(smollm2_dir)]).engine.quantization is None
    monkeypatch.setattr(quant, "cpu_flags", lambda: "flags : fpu avx2")  # a CPU without VNNI: refused at parse
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", str(smollm2_dir), "--quantization", "int8"])
    assert exc.value.code == 2
    assert "error: --quantization int8 needs a CPU with AVX-512-VNNI" in capsys.readouterr().err


@pytest.fixture(scope="module")
def engines(smollm2_dir, tokenizer, make_engine):
    """bf16, int8wo and int8 engines over three loads of SmolLM2-135M (cpu attention backend)."""
    eos = make_engine().stops.eos_ids
    # deterministic inference as by default (on for bf16 here): its extend attention runs the
    # C decode kernel, 2x faster than SDPA over padded 1,000-token masks
    cfg = EngineConfig(model=smollm2_dir, dtype="bfloat16", max_running_requests=32, max_total_tokens=24_000, seed=0)
    out = {}
    for name in ("bf16", "int8wo", "int8"):
        model = load_model(smollm2_dir, torch.bfloat16, attention_backend="cpu")
        c = replace(cfg, quantization=None if name == "bf16" else name)
        apply_quantization(model, c)
        out[name] = Engine(model, tokenizer, eos, c)
    return out


def _score(engine: Engine, windows: list[list[int]], run_all) -> tuple[list[float], list[int]]:
    """Each window's prompt logprobs (its tokens 1..) and top-1 ids, concatenated in order."""
    for i, ids in enumerate(windows):
        engine.add_request(ReqInput(rid=f"w{i}", input_ids=ids, logprob_start_len=0, prompt_top_logprobs_num=1,
                                    sampling=SamplingParams(temperature=0.0, max_new_tokens=1)))
    results = run_all(engine)
    logprobs, top = [], []
    for i, ids in enumerate(windows):
        r = results[f"w{i}"]
        assert r.prompt_start == 1 and len(r.prompt_logprobs) == len(ids) - 1  # token 0 has no prediction
        logprobs += r.prompt_logprobs
        top += r.prompt_top_ids
    return logprobs, top


@needs_vnni
def test_int8_quality_gate_on_python_docs(engines, tokenizer, run_all):
    ids = tokenizer.encode(python_docs_text()).ids
    assert len(ids) >= CORPUS_TOKENS
    windows = [ids[i : i + WINDOW] for i in range(0, CORPUS_TOKENS, WINDOW)]
    lp_bf16, top_bf16 = _score(engines["bf16"], windows, run_all)
    lp_int8, top_int8 = _score(engines["int8wo"], windows, run_all)
    n = len(lp_bf16)
    assert n == len(lp_int8) == CORPUS_TOKENS - len(windows)
    ppl_bf16 = math.exp(-sum(lp_bf16) / n)
    ppl_int8 = math.exp(-sum(lp_int8) / n)
    agree = sum(a == b for a, b in zip(top_bf16, top_int8, strict=True)) / n
    print(f"perplexity bf16 {ppl_bf16:.4f} int8wo {ppl_int8:.4f} ({ppl_int8 / ppl_bf16 - 1:+.2%}); "
          f"greedy agreement {agree:.2%} over {n} tokens")
    assert ppl_int8 <= 1.02 * ppl_bf16
    assert agree >= 0.94  # the regression floor (see the module docstring)
    passes = ppl_int8 <= 1.02 * ppl_bf16 and agree >= 0.97
    assert EngineConfig(model=Path("m")).quantization == ("int8wo" if passes else None)


@needs_vnni
def test_int8_engines_answer_the_readme_question(engines, chat_ids, tokenizer, run_all):
    """Greedy through each engine (deterministic inference as by default)."""
    texts = {}
    for name, engine in engines.items():
        engine.add_request(ReqInput(rid="q", input_ids=chat_ids("What is the capital of Japan?"),
                                    sampling=SamplingParams(temperature=0.0, max_new_tokens=12)))
        texts[name] = tokenizer.decode(run_all(engine)["q"].output_ids)
    assert texts == dict.fromkeys(("bf16", "int8wo", "int8"), "The capital of Japan is Tokyo.")


def _counted(stack) -> tuple[list[bool], Callable]:
    """``stack.forward`` (an ``LayerStack``'s) wrapped to note whether each step ran in C."""
    ran: list[bool] = []
    in_c = stack.forward

    def counted(*args):
        out = in_c(*args)
        ran.append(out is not None)
        return out

    return ran, counted


needs_amx_bf16 = pytest.mark.skipif(not amx_bf16_available(), reason="no AMX-BF16: bf16 runs on oneDNN here")


@pytest.mark.parametrize("method", [pytest.param("int8", marks=needs_vnni), pytest.param("int8wo", marks=needs_vnni),
                                    pytest.param("bf16", marks=needs_amx_bf16)])
def test_fused_norm_and_silu_give_the_same_bits(engines, smollm2_dir, tokenizer, chat_ids, run_all, method,
                                                monkeypatch):
    """The layers in one C call (``models.layer_stack``, every step here: deterministic inference
    attends extend tokens as decode queries), the fused Python loop (``_fused_layers``: RMSNorm
    and SiLU-and-mul inside the linears' C calls) and the separate kernels (another load of the
    model, quantized by ``quantize_model`` and ``choose_kernels`` alone or, bf16, packed by its
    engine, then run layer by layer): the same token ids and logprobs, alone and in a batch of 5
    (no prefix cache: a cache hit changes the prefill's row count, and int8wo's kernel with it)."""
    shared = engines[method]
    fused = shared.runner.model
    assert fused.cpu_fused
    plain = load_model(smollm2_dir, torch.bfloat16, attention_backend="cpu")
    if method != "bf16":
        quant.quantize_model(plain, method)
        quant.choose_kernels(plain, torch.bfloat16, quant.KERNELS if method == "int8" else quant.WEIGHT_ONLY)
    prompts = [chat_ids(q) for q in ("What is the capital of Japan?", "Name a prime.", "Say hi.", "Count to 3.",
                                     "What is 2 + 2?")]
    stack_ran, counted = _counted(fused.layer_stack)
    runs = {}
    for way, model in (("one C call", fused), ("python loop", fused), ("separate kernels", plain)):
        monkeypatch.setattr(fused.layer_stack, "forward", counted if way == "one C call" else lambda *args: None)
        engine = Engine(model, tokenizer, shared.stops.eos_ids, replace(shared.cfg, disable_radix_cache=True))
        if model is plain:
            assert isinstance(plain.layers[0].mlp.down_proj, CpuLinear)
            plain.cpu_fused = False  # the engine fused it: each module runs on its own
        for batch in (prompts[:1], prompts):
            for i, ids in enumerate(batch):
                engine.add_request(ReqInput(rid=f"{len(batch)}-{i}", input_ids=ids, return_logprob=True,
                                            sampling=SamplingParams(temperature=0.0, max_new_tokens=8)))
            runs[way, len(batch)] = {rid: (r.output_ids, r.logprobs) for rid, r in run_all(engine).items()}
    assert [lin.kernels for lin in quant.int8_linears(plain)] == [lin.kernels for lin in quant.int8_linears(fused)]
    assert len(stack_ran) >= 16 and all(stack_ran)  # at least 8 tokens of each batch, every step in C
    for n in (1, 5):
        assert runs["one C call", n] == runs["python loop", n] == runs["separate kernels", n]


@pytest.mark.parametrize("method", [pytest.param("int8", marks=needs_vnni), pytest.param("bf16", marks=needs_amx_bf16)])
def test_the_c_stack_runs_decode_steps_beside_sdpa_prefills(engines, tokenizer, chat_ids, run_all, monkeypatch,
                                                            method):
    """Deterministic inference off: a prefill's extend attention is SDPA's, so its steps run the
    Python loop (``LayerStack.forward`` declines) and the decode steps one C call; the tokens and
    logprobs are the Python loop's on every step."""
    shared = engines[method]
    model = shared.runner.model
    cfg = replace(shared.cfg, disable_radix_cache=True, deterministic_inference=False)
    prompts = [chat_ids(q) for q in ("Name a prime.", "Say hi.", "Count to 3.")]
    stack_ran, counted = _counted(model.layer_stack)
    runs = {}
    for way in ("one C call", "python loop"):
        monkeypatch.setattr(model.layer_stack, "forward", counted if way == "one C call" else lambda *args: None)
        engine = Engine(model, tokenizer, shared.stops.eos_ids, cfg)
        for i, ids in enumerate(prompts):
            engine.add_request(ReqInput(rid=str(i), input_ids=ids, return_logprob=True,
                                        sampling=SamplingParams(temperature=0.0, max_new_tokens=6)))
        runs[way] = {rid: (r.output_ids, r.logprobs) for rid, r in run_all(engine).items()}
    assert stack_ran[0] is False and stack_ran.count(True) >= 5
    assert runs["one C call"] == runs["python loop"]
    assert all(len(ids) == 6 for ids, _ in runs["one C call"].values())
