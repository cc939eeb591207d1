"""The engine on a CUDA device, without a GPU: SmolLM2's shapes (and a tiny Gemma 3) as fake CUDA tensors.

Under ``FakeTensorMode`` every tensor made on ``cuda`` is a fake one: any op that mixes it
with a CPU tensor raises ``FakeTensorDeviceMismatchError``, and any data-dependent read
(``.item()``, ``.tolist()``, ``bool(t)``: a host sync on a real GPU) raises. The runtime's
two copies are replaced: host-to-device makes a fake CUDA tensor of the host tensor's
shape, device-to-host answers a fixed token (so the scheduler's host side -- stops,
lengths, the prefix cache -- runs for real). A whole step sequence must run through:
batched prefill, chunked prefill mixed with decodes, a prefix-cache hit, decodes,
retraction, an abort, a stop token, prompt logprobs (the LM head over a chunk's scored rows,
their targets copied in and the results out through the runtime), a mean-pooled embedding
prefilled in chunks beside the decodes (its rows summed on the device, one copy out when it
ends), for the torch backend
and the Triton backend (its
kernel launches replaced by a check that every argument is on the device), eagerly and
through the CUDA-graph runner's static buffers, with overlap scheduling (the default on
CUDA: decode input ids taken on the device from the step in flight) and without.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

from services.scheduler.config import EngineConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.executor.cuda_graph import DecodeGraphRunner
from services.scheduler.executor.device import CudaRuntime, DeviceRuntime, MemorySplit
from services.scheduler.models import dummy_model
from services.scheduler.policy.req import FinishType, ReqInput, SamplingParams
from services.scheduler.policy.stops import load_eos_ids

CUDA = torch.device("cuda:0")


class FakeCudaRuntime(CudaRuntime):
    """CUDA runtime whose copies make fake tensors and fixed answers; counts both."""

    def __init__(self, mode: FakeTensorMode, token: int):
        super().__init__(CUDA)
        self.mode = mode
        self.token = token
        self.h2d = 0
        self.d2h = 0

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        assert host.device.type == "cpu", f"to_device of a {host.device} tensor"
        self.h2d += 1
        return FakeTensor(self.mode, host.to("meta"), CUDA)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        assert t.device == CUDA, f"to_host of a {t.device} tensor"
        self.d2h += 1
        with unset_fake_temporarily():  # a real host tensor, as a copy would give
            if t.dim() == 1:  # the sampled ids
                return torch.full(tuple(t.shape), self.token, dtype=t.dtype)
            out = torch.zeros(tuple(t.shape), dtype=t.dtype)  # ids, logprob, top ids, top logprobs
            out[:, 0] = self.token
            return out

    to_host_async = DeviceRuntime.to_host_async  # the copy when asked, through to_host above

    def generator(self, seed):
        return None  # a CPU-only torch cannot make a CUDA generator; seeds are tested on CPU

    def memory_split(self, weight_bytes, bytes_per_token, max_total_tokens, kv_cache_gib, mem_fraction, reserve):
        return max_total_tokens, MemorySplit(0, weight_bytes, reserve, max_total_tokens * bytes_per_token)


class CheckedTritonKernels:
    """Stands in for ``kernels.triton_attention``: checks every tensor argument is on the device."""

    def __init__(self):
        self.calls = {"decode_attention": 0, "extend_attention": 0}

    def _check(self, name, args, kwargs, out):
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor):
                assert a.device == CUDA, f"{name}: a {a.device} tensor"
        assert isinstance(kwargs["req_slots"], torch.Tensor) and isinstance(kwargs.get("max_extend_len", 0), int)
        self.calls[name] += 1
        return out

    def decode_attention(self, *args, **kwargs):
        return self._check("decode_attention", args, kwargs, kwargs["out"])

    def extend_attention(self, *args, **kwargs):
        return self._check("extend_attention", args, kwargs, kwargs["out"])


def _req(rid, ids, n, temperature=0.0, **kw):
    return ReqInput(rid=rid, input_ids=ids, sampling=SamplingParams(temperature=temperature, max_new_tokens=n, **kw))


# Gemma 3 (tiny, SmolLM2's vocabulary): sliding-window and global layers, q/k norms, soft-capped logits.
GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], vocab_size=49152, hidden_size=64, intermediate_size=96,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
              max_position_embeddings=2048, sliding_window=8, final_logit_softcapping=15.0,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


@pytest.mark.parametrize("backend,graphs,overlap,arch", [("torch", False, False, "llama"),
                                                         ("torch", True, True, "llama"),
                                                         ("triton", False, True, "llama"),
                                                         ("triton", True, True, "gemma3")])
def test_step_sequence_on_fake_cuda_tensors(smollm2_dir, tokenizer, backend, graphs, overlap, arch):
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    token = tokenizer.token_to_id("Ġthe")
    runtime = FakeCudaRuntime(mode, token)
    cfg = EngineConfig(model=smollm2_dir, max_running_requests=8, max_total_tokens=128, chunked_prefill_size=32,
                       max_prefill_tokens=64, attention_backend=backend, disable_cuda_graph=True,
                       overlap_schedule=overlap, embedding_pooling="mean")
    # SmolLM2's shapes with 2 of its 30 layers: every layer runs the same code, and the fake
    # tensors' per-op bookkeeping makes each layer cost about a second a step sequence.
    hf = {**json.loads((smollm2_dir / "config.json").read_text()), "num_hidden_layers": 2}
    eos = load_eos_ids(smollm2_dir, tokenizer)
    with mode:
        model = dummy_model(hf if arch == "llama" else GEMMA3, torch.bfloat16, seed=None, attention_backend=backend,
                            runtime=runtime)
        kernels = None
        if backend == "triton":
            kernels = model.attn_backend.kernels = CheckedTritonKernels()
        engine = Engine(model, tokenizer, eos, cfg, runtime)
        if graphs:
            engine.runner.graph_runner = DecodeGraphRunner(model, runtime, engine.req_pool, engine.kv_pool, 4,
                                                           capture=False)
        assert {p.device for p in model.parameters()} == {CUDA}
        assert engine.kv_pool.k_buffer[0].device == CUDA and engine.req_pool.device_table.device == CUDA
        assert engine.req_pool.req_to_token.device.type == "cpu"  # the scheduler's own copy

        results: dict[str, list] = {}
        cached: dict[str, int] = {}
        sample, samples = engine.sampler.sample, []

        def counted_sample(logits, reqs):
            samples.append(len(reqs))
            return sample(logits, reqs)

        engine.sampler.sample = counted_sample
        forward, scored = engine.runner.forward, []

        def scoring_forward(plan, future=None):
            scored.append(plan.logprob_rows is not None)
            return forward(plan, future)

        engine.runner.forward = scoring_forward
        prompt_logprobs: dict[str, tuple[int, int, int]] = {}
        embeddings: dict[str, int] = {}

        def step():
            out = engine.step()
            if out is None:
                return
            for i, rid in enumerate(out.rids):
                results.setdefault(rid, []).append(out.finish_reasons[i])
                cached[rid] = out.cached_tokens[i]
            for p in out.prompt_logprobs:
                prompt_logprobs[out.rids[p.row]] = (p.start, len(p.logprobs), len(p.top_ids))
            for e in out.embeddings:
                embeddings[out.rids[e.row]] = len(e.values)

        def drain():
            while engine.has_work:
                step()

        prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog near the river bank").ids
        # Batched prefill of two prompts, with logprobs for one of them.
        engine.add_request(ReqInput(rid="a", input_ids=prompt, return_logprob=True, top_logprobs_num=2,
                                    sampling=SamplingParams(temperature=0.0, max_new_tokens=3)))
        engine.add_request(_req("b", prompt[:5], 30, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=20,
                                frequency_penalty=0.5, repetition_penalty=1.2, logit_bias=((5, 1.0),)))
        step()
        # A 45-token prompt prefilled in chunks of 32 beside the running decodes.
        engine.add_request(_req("c", (prompt * 4)[:45], 60, ignore_eos=True))
        step()
        # An embedding prefilled in chunks beside them: samples nothing, pools every row.
        engine.add_request(ReqInput(rid="m", input_ids=(prompt * 3)[:40], sampling=SamplingParams(max_new_tokens=0),
                                    embed=True))
        step()
        while "a" in engine.reqs:
            step()
        # a finished into the prefix cache: d's prompt starts with it.
        engine.add_request(_req("d", prompt + tokenizer.encode(" and more").ids, 60, ignore_eos=True))
        # A stop token below min_new_tokens is banned, then stops the request.
        engine.add_request(_req("e", prompt[:3], 20, stop_token_ids=frozenset({token}), min_new_tokens=2))
        # Prompt logprobs from position 1 with the top 2 at each.
        engine.add_request(ReqInput(rid="s", input_ids=prompt, logprob_start_len=1, prompt_top_logprobs_num=2,
                                    sampling=SamplingParams(temperature=0.0, max_new_tokens=2)))
        for _ in range(6):
            step()
        engine.abort("b")
        drain()

    assert results["a"][-1].type == FinishType.LENGTH
    assert results["b"][-1].type == FinishType.ABORT
    assert results["c"][-1].type == FinishType.LENGTH and results["d"][-1].type == FinishType.LENGTH
    assert results["e"][-1].type == FinishType.STOP and results["e"][-1].matched_token_id == token
    assert len(results["e"]) == 2  # the stop token (answered every step) ends it only at min_new_tokens
    assert cached["d"] == len(prompt) and cached["c"] == 0  # d's prompt starts with a's, cached
    assert engine.policy.num_retracted > 0  # 128 KV rows cannot hold c's and d's decodes
    load = engine.load()
    assert (load.req_slots_used, load.kv_used_tokens, load.num_running_reqs, load.num_waiting_reqs) == (0, 0, 0, 0)
    assert load.kv_cached_tokens + engine.kv_pool.available == 128
    assert prompt_logprobs == {"s": (1, len(prompt) - 1, 2 * (len(prompt) - 1))}
    assert results["s"][-1].type == FinishType.LENGTH and sum(scored) >= 1
    hidden_size = (GEMMA3 if arch == "gemma3" else hf)["hidden_size"]
    assert results["m"] == [results["m"][-1]] and results["m"][-1].type == FinishType.LENGTH
    assert embeddings == {"m": hidden_size}
    # One device-to-host copy per step that samples, three per step that scores a prompt
    # (chosen logprobs, top values, top ids), and one for the step that ends the embedding.
    assert runtime.d2h == len(samples) + 3 * sum(scored) + 1 and len(samples) > 10
    if kernels is not None:
        assert kernels.calls["extend_attention"] > 0 and kernels.calls["decode_attention"] > 0


def test_lora_steps_on_fake_cuda_tensors(smollm2_dir, tokenizer, monkeypatch):
    """Steps with adapter rows beside base rows on CUDA: the adapters stacked on the device, the
    segmented kernel (its launch replaced by a check of its arguments) given device tensors
    and a host int, and no host sync (a data-dependent read of a fake tensor raises)."""
    from services.scheduler.lora import registry, stacked
    from services.scheduler.lora.adapter import AdapterWeights

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    runtime = FakeCudaRuntime(mode, tokenizer.token_to_id("Ġthe"))
    cfg = EngineConfig(model=smollm2_dir, max_running_requests=4, max_total_tokens=128, chunked_prefill_size=32,
                       attention_backend="torch", disable_cuda_graph=True, overlap_schedule=True, max_loras=2,
                       max_lora_rank=8)
    hf = {**json.loads((smollm2_dir / "config.json").read_text()), "num_hidden_layers": 2}
    launches = []

    def checked_sgmv(x, out, a, b, scales, rows, segments, max_len):
        assert {t.device for t in (x, out, a, b, scales, rows, segments)} == {CUDA} and isinstance(max_len, int)
        launches.append((tuple(a.shape), tuple(segments.shape), max_len))
        return out

    def read(path, shapes, num_layers, max_rank):  # the adapter's tensors, made under the fake mode
        return AdapterWeights(8, 2.0, {(i, m): (torch.zeros(8, fin), torch.zeros(fout, 8))
                                       for i in range(num_layers) for m, (fin, fout) in shapes.items()})

    monkeypatch.setattr(stacked, "segmented_kernel", lambda: checked_sgmv)
    monkeypatch.setattr(registry, "read_adapter", read)
    eos = load_eos_ids(smollm2_dir, tokenizer)
    with mode:
        model = dummy_model(hf, torch.bfloat16, seed=None, attention_backend="torch", runtime=runtime)
        engine = Engine(model, tokenizer, eos, cfg, runtime)
        engine.lora.load("ad", "unused")
        prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog").ids
        engine.add_request(_req("base", prompt, 3, ignore_eos=True))
        engine.add_request(ReqInput(rid="lora", input_ids=prompt[:5], lora_name="ad",
                                    sampling=SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)))
        steps = 0
        while engine.has_work:
            steps += engine.step() is not None
    stack = model.layers[0].self_attn.qkv_proj.stack
    assert stack.a.device == CUDA and tuple(stack.a.shape) == (1, 3 * 16, 576)  # rank 8 padded to 16
    # 2 layers x 4 linears per step with the adapter's rows (its prefill, then 2 decodes): one
    # segment of 5 rows, then of 1.
    assert [(s, n) for _, s, n in launches[::8]] == [((3, 1), 5), ((3, 1), 1), ((3, 1), 1)]
    assert len(launches) == 3 * 8 and steps == 3
    assert runtime.d2h == steps  # the sampled ids only
