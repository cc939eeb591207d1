"""The GPU check's serving-feature parts (``bench/gpu_check.py --parts speculative,disagg,lora``).

- ``check_speculative``: n-gram speculative decoding in the engine against the same engine
  without it, under deterministic inference: greedy ids and logprobs of a few prompts (one
  copy-heavy) must be equal, with CUDA graphs on (the steps without drafts replay them; a
  step with drafted rows runs eagerly); then the copy workload's output tok/s at
  concurrency 1 with ``--speculative-algorithm ngram`` against without
  (``ringserve bench compare --workload copy``).
- ``check_disagg``: the ring launched with one prefill and one decode scheduler on the same
  device, against one co-located scheduler, deterministic inference on both: the same greedy
  text and logprobs; then long prompts through the pair, and the KV transfer throughput from
  the prefill scheduler's ``ringserve:kv_transfer_bytes_total`` / ``..._seconds_total``.
- ``check_lora``: two PEFT adapters (made here with peft) and the base model in one batch,
  fp32, against transformers running each adapter merged into the weights (logits at every
  recorded row, greedy agreement); the wall time of such a batch against a base-only one of
  the same size, both eager (the cost of the engine's LoRA product); and, where the checkout
  has the segmented Triton kernel, its time against the grouped torch product on one
  Llama-3-8B-shaped layer (``lora_kernel_timing``).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from bench.device_engine import make_engine, run_outputs
from bench.disagg import _launch, _scrape, _stop
from ringserve.bench.workloads import copy_requests
from services.scheduler.engine.engine import Engine
from services.scheduler.policy.req import ReqInput, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
PLAIN = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
ECHO = "Repeat exactly: The red fox ran over the hill and the red fox slept. The red fox ran over the hill."
# Two adapters of different ranks and targets (one rsLoRA), as tests/scheduler/test_lora.py makes them.
# One decoder layer of Llama-3-8B's shapes (bench/gpu_check.py's LLAMA3_8B), a small vocabulary.
LLAMA3_8B_LAYER = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1024, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 1, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
                   "tie_word_embeddings": False}
ADAPTERS = {"qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
            "all": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=[
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}


def _greedy(rid: str, ids: list[int], n: int, lora: str = "") -> ReqInput:
    return ReqInput(rid=rid, input_ids=ids, return_logprob=True, lora_name=lora,
                    sampling=SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))


def _prompt_ids(model_dir: Path, passage_len: int) -> list[list[int]]:
    """The plain prompts, a chat one asking to repeat a sentence and the copy workload's first
    prompt (a documentation passage of ``passage_len`` tokens to repeat), as token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    copy_text = copy_requests(1, passage_len, 0, tok.backend_tokenizer)[0].prompt_text or ""

    def chat(text: str) -> list[int]:
        return tok(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False).input_ids

    return [tok(p).input_ids for p in PLAIN] + [chat(ECHO), chat(copy_text)]


def check_speculative(model_dir: Path, device: str, quick: bool, json_path: Path) -> dict:
    """N-gram speculative decoding against none on ``device`` (module docstring)."""
    prompts = _prompt_ids(model_dir, 64 if quick else 256)
    new = 16 if quick else 96
    reqs = [_greedy(f"s{i}", ids, new) for i, ids in enumerate(prompts)]
    runs, counts = {}, {}
    for algo in ("none", "ngram"):
        engine = make_engine(model_dir, device, "bfloat16", deterministic_inference=True, speculative_algorithm=algo)
        counts[algo] = _count_steps(engine)
        t = time.perf_counter()
        runs[algo] = run_outputs(engine, reqs)
        counts[algo]["wall_s"] = round(time.perf_counter() - t, 3)
    assert engine.speculator is not None  # the n-gram engine, the last built
    stats = engine.speculator.stats
    last = f"s{len(reqs) - 1}"
    result: dict = {
        "prompts": len(reqs), "new_tokens": new,
        "differ": sum(runs["ngram"][r] != runs["none"][r] for r in runs["none"]),
        "copy_prompt_identical": runs["ngram"][last] == runs["none"][last],
        "proposed": stats.proposed, "accepted": stats.accepted,
        "acceptance_length": round(stats.acceptance_length, 3), "steps": counts}
    out = json_path.with_name("gpu_check_speculative.json")
    subprocess.run([sys.executable, "-m", "ringserve.cli", "bench", "compare", "--model", str(model_dir), "--device",
                    device, "--workload", "copy", "--skip-hf", "--concurrency", "1", "--input-len",
                    "64" if quick else "256", "--output-len", "16" if quick else "256", "--min-prompts",
                    "2" if quick else "8", "--ringserve-variant", "ngram:--speculative-algorithm ngram",
                    "--json", str(out), "--disable-progress"], cwd=ROOT, check=True)
    bench = json.loads(out.read_text())
    on, off = (bench["results"][s]["1"]["output_throughput"] for s in ("ringserve-ngram", "ringserve"))
    result["copy_c1_tok_s"] = {"ngram": round(on, 1), "none": round(off, 1), "ratio": round(on / off, 3)}
    result["copy_c1_speculation"] = bench["speculation"].get("ringserve-ngram", {})
    return result


def _count_steps(engine: Engine) -> dict:
    """Count, as ``engine`` runs, its forwards, those with drafted rows and the CUDA-graph replays."""
    counts = {"forwards": 0, "drafted": 0, "graph_replays": 0}
    forward = engine.runner.forward

    def counted(plan, future=None):
        counts["forwards"] += 1
        counts["drafted"] += bool(plan.drafts)
        return forward(plan, future)

    engine.runner.forward = counted
    graphs = engine.runner.graph_runner
    if graphs is not None:
        replay = graphs.forward

        def replayed(plan, future=None):
            counts["graph_replays"] += plan.is_decode and graphs.bucket(len(plan.reqs)) in graphs.graphs
            return replay(plan, future)

        graphs.forward = replayed
    return counts


def _complete(base: str, ids: list[int], n: int) -> tuple[str, list[float]]:
    """One greedy completion of ``ids`` -> (text, each token's logprob)."""
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def check_disagg(model_dir: Path, device: str, quick: bool) -> dict:
    """One prefill + one decode scheduler on the same device against a co-located one (module docstring)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(p).input_ids for p in PLAIN + [ECHO]]
    new = 8 if quick else 32
    # "cuda" would give the second scheduler cuda:1: the device named, both share it. The KV
    # pool size (--max-total-tokens, to each scheduler) keeps the two within the one device.
    same = ["--device", "cuda:0" if device == "cuda" else device, "--enable-deterministic-inference"]
    kv_tokens = 8192 if quick else 65536
    long_len, longs = (256, 2) if quick else (4096, 16)
    gen = torch.Generator().manual_seed(0)
    long_ids = [torch.randint(100, 40000, (long_len,), generator=gen).tolist() for _ in range(longs)]
    outputs, result = {}, {}
    for name, flags in (("colocated", same), ("pd", [*same, "--prefill-replicas", "1", "--decode-replicas", "1"])):
        proc, base, metrics_url = _launch(model_dir, flags, kv_tokens)
        try:
            outputs[name] = [_complete(base, ids, new) for ids in prompts]
            if name == "pd":
                t = time.perf_counter()
                for ids in long_ids:
                    _complete(base, ids, 2)
                wall = time.perf_counter() - t
                metrics = _scrape(metrics_url)  # the first scheduler's: the prefill one
        finally:
            _stop(proc)
    moved, seconds = metrics["ringserve:kv_transfer_bytes_total"], metrics["ringserve:kv_transfer_seconds_total"]
    result["prompts"] = len(prompts)
    result["text_differ"] = sum(a[0] != b[0] for a, b in zip(outputs["pd"], outputs["colocated"], strict=True))
    result["logprobs_differ"] = sum(a[1] != b[1] for a, b in zip(outputs["pd"], outputs["colocated"], strict=True))
    result["long_prompts"] = f"{longs} x {long_len} tokens, {wall:.2f} s"
    result["kv_transfer_bytes"] = moved
    result["kv_transfer_gb_s"] = moved / seconds / 1e9 if seconds else None
    return result


def check_lora(model_dir: Path, device: str, quick: bool, workdir: Path) -> dict:
    """Two adapters and the base in one batch against the adapters merged (module docstring)."""
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    merged: dict[str, torch.nn.Module] = {"": base.to(device)}
    for seed, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        model = peft.get_peft_model(copy.deepcopy(base).cpu(), peft.LoraConfig(init_lora_weights=False, **kw))
        with torch.no_grad():  # peft's random B is as large as A: a visible, moderate change
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.05)
        model.save_pretrained(workdir / name)
        merged[name] = model.merge_and_unload().eval().to(device)
    # No CUDA graphs: a step with adapter rows runs eagerly, so the base-only batch timed below
    # does too, and the two walls differ by the LoRA product alone.
    engine = make_engine(model_dir, device, "float32", max_loras=len(ADAPTERS), max_lora_rank=16,
                         lora_modules=tuple(f"{n}={workdir / n}" for n in ADAPTERS), max_running_requests=64,
                         disable_cuda_graph=True)
    rows: list[tuple[str, list[int], torch.Tensor]] = []
    forward = engine.runner.forward

    def recorded(plan, future=None):
        logits = forward(plan, future)
        for row, (req, p, n) in enumerate(zip(plan.reqs, plan.prefix_lens, plan.extend_lens, strict=True)):
            rows.append((req.lora.name if req.lora is not None else "", req.fill_ids()[: p + n], logits[row].cpu()))
        return logits

    engine.runner.forward = recorded
    prompts = [tok(p).input_ids for p in PLAIN]
    run_outputs(engine, [_greedy(f"{name or 'base'}-{i}", ids, 4, name) for i, ids in enumerate(prompts)
                         for name in merged])
    engine.runner.forward = forward
    worst = dict.fromkeys(merged, 0.0)
    agree = 0
    with torch.inference_mode():
        for name, ids, got in rows:
            want = merged[name](torch.tensor([ids], device=device)).logits[0, -1].float().cpu()
            worst[name] = max(worst[name], (want - got).abs().max().item())
            agree += int(want.argmax() == got.argmax())
    result: dict = {"rows": len(rows), "top1_agree": f"{agree}/{len(rows)}",
                    "logits_max_abs_err": {name or "base": err for name, err in worst.items()}}
    # The same batch size with every row on the base, then a third of it on each adapter.
    batch, new = (6, 4) if quick else (48, 64)
    walls = {}
    for label, names in (("base_only", [""]), ("two_adapters_and_base", list(merged))):
        reqs = [_greedy(f"t{label}{i}", prompts[i % len(prompts)] + [100 + i], new, names[i % len(names)])
                for i in range(batch)]
        t = time.perf_counter()
        run_outputs(engine, reqs)
        walls[label] = time.perf_counter() - t
    result["batch_wall_s"] = {**{k: round(v, 3) for k, v in walls.items()}, "batch": batch, "new_tokens": new,
                              "ratio": round(walls["two_adapters_and_base"] / walls["base_only"], 3)}
    result["lora_product"] = "the engine's own (CUDA: the segmented kernel where the checkout has it), both eager"
    result["kernel_vs_torch"] = lora_kernel_timing(device, quick)
    return result


def lora_kernel_timing(device: str, quick: bool) -> dict:
    """The segmented Triton LoRA kernel (``kernels.triton_lora``, the CUDA path) against the
    grouped torch product (the CPU path) on every wrapped linear of one Llama-3-8B-shaped
    bf16 layer (``quick``: a tiny one), 4 adapters of rank 16 on every module: a decode batch
    of 64 rows (quick: 10) and a prefill of 4 x 512 tokens (quick: 2 x 8), one row in five on
    the base. Per batch: ms per layer of the base linears alone, of the linears with each
    product, and the largest |kernel - torch| / (1 + |torch|). Runs where the checkout has the
    kernel (``LoraModel(segmented=...)``), on CUDA or under ``TRITON_INTERPRET=1``."""
    import inspect

    from services.scheduler.executor.device import create_runtime
    from services.scheduler.lora.adapter import AdapterWeights
    from services.scheduler.lora.layers import LoraModel
    from services.scheduler.lora.registry import step_rows
    from services.scheduler.models import dummy_model

    if "segmented" not in inspect.signature(LoraModel).parameters:
        return {"skipped": "no segmented LoRA kernel in this checkout"}
    if not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        return {"skipped": "the kernel needs CUDA or TRITON_INTERPRET=1"}
    hf = {**LLAMA3_8B_LAYER, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16} if quick else LLAMA3_8B_LAYER
    runtime = create_runtime(torch.device(device))
    models = {seg: LoraModel(dummy_model(hf, torch.bfloat16, seed=0, runtime=runtime), segmented=seg)
              for seg in (False, True)}
    gen = torch.Generator().manual_seed(0)
    for slot in range(4):
        shapes = models[False].shapes
        weights = AdapterWeights(16, 1.0, {(0, m): (torch.randn(16, i, generator=gen) / 64,
                                                    torch.randn(o, 16, generator=gen) / 64)
                                           for m, (i, o) in shapes.items()})
        for m in models.values():
            m.add(slot, weights)
    slots = [None, 0, 1, 2, 3]
    batches = {"decode": ([slots[i % 5] for i in range(10 if quick else 64)], [1] * (10 if quick else 64)),
               "prefill": ([0, None, 1, 2] if not quick else [0, None], [8 if quick else 512] * (2 if quick else 4))}
    iters = 2 if quick else 20
    out: dict = {"layer": "tiny" if quick else "Llama-3-8B"}
    for name, (req_slots, counts) in batches.items():
        lora = step_rows(req_slots, counts)
        assert lora is not None
        xs = [torch.randn(sum(counts), lin.in_local, generator=gen).to(device, torch.bfloat16)
              for lin in models[False].linears]
        for m in models.values():
            m.batch.set(lora[1], lora[0].to(device))
        row: dict = {"rows": sum(counts)}
        row["base_ms"] = _ms([lin.base for lin in models[False].linears], xs, device, iters)
        row["torch_ms"] = _ms(models[False].linears, xs, device, iters)
        row["triton_ms"] = _ms(models[True].linears, xs, device, iters)
        worst = 0.0
        for a, b, x in zip(models[False].linears, models[True].linears, xs, strict=True):
            want, got = a(x).float(), b(x).float()
            worst = max(worst, ((got - want).abs() / (1 + want.abs())).max().item())
        row["max_rel_err"] = worst
        out[name] = row
    return out


def _ms(linears: list, xs: list[torch.Tensor], device: str, iters: int) -> float:
    """Mean wall milliseconds of every ``linears[i](xs[i])`` over ``iters`` runs after 3 warm-up
    runs (the device synchronized)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for i in range(3 + iters):
        if i == 3:
            sync()
            t = time.perf_counter()
        for lin, x in zip(linears, xs, strict=True):
            lin(x)
    sync()
    return round((time.perf_counter() - t) / iters * 1e3, 4)


def markdown(r: dict) -> list[str]:
    """The Markdown lines of the parts present in report ``r``."""
    lines = []
    if "speculative" in r:
        s = r["speculative"]
        lines.append(f"- n-gram speculative decoding vs none (deterministic, bf16): {s['differ']} of {s['prompts']} "
                     f"prompts differ, acceptance length {s['acceptance_length']}, steps {json.dumps(s['steps'])}; "
                     f"copy workload at concurrency 1: {s['copy_c1_tok_s']['ngram']} vs {s['copy_c1_tok_s']['none']}"
                     f" output tok/s ({s['copy_c1_tok_s']['ratio']}x)")
    if "disagg" in r:
        d = r["disagg"]
        gbs = f"{d['kv_transfer_gb_s']:.2f} GB/s" if d["kv_transfer_gb_s"] else "-"
        lines.append(f"- prefill/decode pair on one device vs co-located (deterministic): text differs on "
                     f"{d['text_differ']}, logprobs on {d['logprobs_differ']} of {d['prompts']} prompts; KV transfer "
                     f"{gbs} ({d['kv_transfer_bytes'] / 1e6:.1f} MB; {d['long_prompts']})")
    if "lora" in r:
        lo = r["lora"]
        lines.append(f"- multi-LoRA (two adapters + base, fp32) vs merged: top-1 {lo['top1_agree']}, max abs logit "
                     f"error {json.dumps(lo['logits_max_abs_err'])}; batch wall {json.dumps(lo['batch_wall_s'])} "
                     f"({lo['lora_product']}); segmented Triton kernel vs grouped torch product, every wrapped linear "
                     f"of one bf16 layer, 4 adapters of rank 16: {json.dumps(lo['kernel_vs_torch'])}")
    return lines
