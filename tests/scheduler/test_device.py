"""Device choice, dtype resolution and memory sizing per device kind, without a GPU: the
CUDA runtime's figures come from torch.cuda functions replaced by fixed answers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from services.scheduler.attention.backends import create_attention_backend
from services.scheduler.config import EngineConfig
from services.scheduler.executor import device as devmod
from services.scheduler.executor.cuda_graph import graph_buckets
from services.scheduler.executor.device import CudaRuntime, DeviceRuntime, create_runtime, resolve_device
from services.scheduler.kernels import triton_moe
from services.scheduler.layers import linear
from services.scheduler.main import parse_args
from services.scheduler.policy.kv_pool import GIB


def test_dtype_auto_follows_the_cpu(monkeypatch):
    cpu = DeviceRuntime(torch.device("cpu"))
    assert cpu.resolve_dtype("float32") == torch.float32
    monkeypatch.setattr(devmod, "cpu_has_bf16", lambda: True)
    assert cpu.resolve_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(devmod, "cpu_has_bf16", lambda: False)
    assert cpu.resolve_dtype("auto") == torch.float32
    with pytest.raises(ValueError, match="dtype 'float16' is not supported on cpu; supported: auto, bfloat16, float32"):
        cpu.resolve_dtype("float16")


def test_dtype_auto_on_cuda_follows_the_compute_capability(monkeypatch):
    cuda = CudaRuntime(torch.device("cuda:0"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cuda.resolve_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert cuda.resolve_dtype("auto") == torch.float16
    assert cuda.resolve_dtype("float16") == torch.float16
    assert cuda.resolve_dtype("float32") == torch.float32


def test_device_auto_is_the_cpu_here_and_cuda_is_refused_by_name():
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert type(create_runtime(torch.device("cpu"))) is DeviceRuntime
    assert type(create_runtime(torch.device("cuda:1"))) is CudaRuntime
    with pytest.raises(RuntimeError,
                       match=r"--device cuda: torch sees 0 CUDA device\(s\) \(this torch is a CPU-only build\)"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="unsupported device 'meta'"):
        resolve_device("meta")
    assert parse_args(["--model", "m", "--device", "cuda:1"]).engine.device == "cuda:1"
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--device", "tpu"])


def test_cuda_kv_pool_takes_what_the_static_fraction_leaves(monkeypatch):
    # An 80 GiB device with 16 GiB in use (weights): 0.85 * 80 - 16 - 2 (reserve) = 50 GiB of KV.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (64 * GIB, 80 * GIB))
    cuda = CudaRuntime(torch.device("cuda:0"))
    per_token = 128 * 1024  # Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 x 2 x 2 bytes
    tokens, split = cuda.memory_split(16 * GIB, per_token, None, None, 0.85, 2 * GIB)
    assert tokens == 50 * GIB // per_token == 409600
    assert (split.total, split.weights, split.reserve, split.kv_cache) == (80 * GIB, 16 * GIB, 2 * GIB, 50 * GIB)
    assert cuda.memory_split(16 * GIB, per_token, 1000, None, 0.85, 2 * GIB)[0] == 1000
    assert cuda.memory_split(16 * GIB, per_token, None, 1.0, 0.85, 2 * GIB)[0] == 8192
    with pytest.raises(ValueError, match="the KV pool would hold 0 tokens \\(--mem-fraction-static 0.2 of 80.00 GiB, "
                                         "16.00 GiB in use, reserve 2.00 GiB"):
        cuda.memory_split(16 * GIB, per_token, None, None, 0.2, 2 * GIB)


def test_cuda_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_buckets(160)[-3:] == [144, 152, 160] and len(graph_buckets(160)) == 23
    with pytest.raises(ValueError, match="--cuda-graph-max-bs must be >= 1"):
        graph_buckets(0)


def test_every_device_decision_is_the_runtimes(monkeypatch):
    """What differs between the CPU and CUDA, asked of the runtime (the engine and the model
    builder hand it on): defaults, kernels, the req-to-token mirror and the collectives."""
    cfg = EngineConfig(model=Path("m"), kv_cache_mem_fraction=0.3, mem_fraction_static=0.85)
    cpu, cuda = DeviceRuntime(torch.device("cpu")), CudaRuntime(torch.device("cuda:0"))
    invariant, plain = SimpleNamespace(batch_invariant=True), SimpleNamespace(batch_invariant=False)
    assert (cpu.kv_mem_fraction(cfg), cuda.kv_mem_fraction(cfg)) == (0.3, 0.85)
    assert (cpu.overlap_default, cuda.overlap_default) == (False, True)
    assert (cpu.mirrors_tables, cuda.mirrors_tables) == (False, True)
    assert (cpu.dist_backend, cuda.dist_backend) == ("gloo", "nccl")
    assert (cpu.default_attention_backend, cuda.default_attention_backend) == ("cpu", "triton")
    assert (cpu.batch_invariant_linears, cuda.batch_invariant_linears) == ("padded", "triton")
    assert (cpu.int8_linears, cuda.int8_linears) == (True, False)
    assert cpu.deterministic_default(torch.bfloat16, invariant)
    assert not cpu.deterministic_default(torch.float32, invariant)
    assert not cpu.deterministic_default(torch.bfloat16, plain)
    assert not cuda.deterministic_default(torch.bfloat16, invariant)
    assert cpu.fused_experts() is None and cuda.fused_experts() is triton_moe.fused_experts
    assert cpu.packs_linears == linear.onednn_bf16() and not cuda.packs_linears
    assert cpu.attention_backend_refusal("cpu") is None and cuda.attention_backend_refusal("triton") is None
    assert cuda.attention_backend_refusal("cpu") == "attention backend 'cpu' runs on the CPU, not on cuda"
    with pytest.raises(RuntimeError, match=r"^attention backend 'cpu' runs on the CPU, not on cuda$"):
        create_attention_backend("cpu", cuda)
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    cpu.bind()
    cuda.bind()
    assert current == [torch.device("cuda:0")]
