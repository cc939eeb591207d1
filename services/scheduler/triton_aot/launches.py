"""Every Triton launch the scheduler's CUDA path makes, at the shapes of real models, on fake tensors.

Each model is built as the engine builds it on a GPU (``dummy`` weights, ``--attention-backend
triton``, device ``cuda``) under ``FakeTensorMode``: tensors have shapes, dtypes and a CUDA
device but no data, so a CPU-only torch runs the model's CUDA code path, and each Triton
launch goes through the kernels' own wrappers (which pick tiles and constexprs) into
``compiler.capturing``. The steps, in every dtype ``CudaRuntime`` offers:

- mixed: a fresh prompt and an extend after a cached prefix, beside three decodes (the
  extend and decode attention kernels, the fused-MoE grouped GEMM);
- the same step with a LoRA adapter (rank 16, every linear it can adapt) on the fresh prompt
  and the decodes (the segmented LoRA kernel's shrink and expand);
- the same step with deterministic inference (``make_batch_invariant``: the batch-invariant
  GEMM and RMSNorm; extend tokens attended by the decode kernel), and a batch-1 decode step
  with it (the smallest step: where a tile table keyed by the token count would pick its
  decode entry, and where the JIT would specialize a token count of 1);
- each of those again in bf16 with every attention layer's ``softcap`` on, for a model whose
  family defines it (Gemma 3's, which no released config switches on: ``SOFTCAPPED``).

A kernel, a tile table or a variant added to the code is launched by these steps without a
change here; a kernel no step launches shows up in ``unlaunched``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.runtime.jit import JITFunction

from services.scheduler.attention.paged import AttnMetadata, DecodeLayout, ExtendLayout
from services.scheduler.executor.device import CudaRuntime
from services.scheduler.layers.batch_invariant import make_batch_invariant
from services.scheduler.lora.adapter import AdapterWeights
from services.scheduler.lora.layers import attach_lora
from services.scheduler.lora.registry import step_rows
from services.scheduler.models import dummy_model
from services.scheduler.models.blocks import Attention
from services.scheduler.policy.kv_pool import TokenToKVPool
from services.scheduler.triton_aot.compiler import Call, capturing

CUDA = torch.device("cuda:0")
# Every layer of a model runs the same code, so each model keeps one layer of each kind.
# config.json of meta-llama/Meta-Llama-3-8B.
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "max_position_embeddings": 8192, "tie_word_embeddings": False, "hidden_act": "silu"}
# google/gemma-3-270m (the figures of the packaged GGUF): head_dim 256, sliding window 512.
GEMMA3_270M = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
               "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768, "sliding_window": 512,
               "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 256,
               "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_local_base_freq": 1e4}
# Qwen/Qwen3-30B-A3B: 128 experts of 768 over hidden 2048, top 8; q/k norms.
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
                 "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960,
                 "tie_word_embeddings": False, "hidden_act": "silu"}
# Qwen/Qwen2.5-7B-Instruct: biased q/k/v projections.
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
             "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 32768, "tie_word_embeddings": False,
             "hidden_act": "silu"}
SOFTCAP = 30.0  # any cap > 0 selects the soft-capped kernels
# The shapes whose family defines attention logit soft-capping (Gemma's); no other family's
# attention is ever capped, so their capped variants are not compiled.
SOFTCAPPED = frozenset({"Gemma-3-270M"})


def models(smollm2_dir: Path) -> dict[str, dict]:
    """The model shapes compiled for: name -> HF config (SmolLM2's read from the packaged model)."""
    smollm2 = json.loads((smollm2_dir / "config.json").read_text())
    return {"SmolLM2-135M": smollm2, "Llama-3-8B": LLAMA3_8B, "Qwen2.5-7B": QWEN25_7B, "Gemma-3-270M": GEMMA3_270M,
            "Qwen3-30B-A3B": QWEN3_30B_A3B}


def _step(model: torch.nn.Module, kv: TokenToKVPool, extend: list[tuple[int, int]], decode: list[int],
          per_token: bool) -> None:
    """One forward + logits of a step: ``extend`` (cached prefix, new tokens) per request, then
    one token per ``decode`` entry (its key count); index tensors as ``ModelRunner`` lays them out."""
    ne = sum(n for _, n in extend)
    t = ne + len(decode)
    longest = max([p + n for p, n in extend] + decode)
    i64 = lambda n: torch.zeros(n, dtype=torch.int64, device=CUDA)  # noqa: E731 (no data: fake tensors)
    table = torch.zeros(len(extend) + len(decode) + 1, longest + 64, dtype=torch.int32, device=CUDA)
    meta = AttnMetadata(i64(t), table, ne)
    if extend:
        lq = max(n for _, n in extend)
        meta.extend = ExtendLayout(i64(len(extend)), i64(len(extend)), i64(len(extend)), i64(ne), lq,
                                   max(p + n for p, n in extend))
        if per_token:
            meta.extend.token_rows, meta.extend.token_slots, meta.extend.token_seq_lens = i64(ne), i64(ne), i64(ne)
    if decode:
        meta.decode = DecodeLayout(i64(len(decode)), i64(len(decode)), max(decode))
    hidden = model(i64(t), i64(t), meta, kv)
    model.compute_logits(hidden.index_select(0, i64(len(extend) + len(decode))))


def _lora_step(model: torch.nn.Module, kv: TokenToKVPool, extend: list[tuple[int, int]], decode: list[int]) -> None:
    """``_step`` with an adapter in slot 0 on the first request and the decodes, the others the
    base model's (``LoraModel`` on a CUDA model: the stacked weights and the segmented kernel)."""
    lora = attach_lora(model)
    r = 16
    lora.add(0, AdapterWeights(r, 2.0, {(i, m): (torch.zeros(r, fin), torch.zeros(fout, r))
                                        for i in range(lora.num_layers) for m, (fin, fout) in lora.shapes.items()}))
    slots = [0] + [None] * (len(extend) - 1) + [0] * len(decode)
    step = step_rows(slots, [n for _, n in extend] + [1] * len(decode))
    assert step is not None  # slot 0 has rows
    lora.batch.set(step[1], step[0].to(CUDA))
    try:
        _step(model, kv, extend, decode, per_token=False)
    finally:
        lora.batch.set(None, None)


@contextlib.contextmanager
def _contiguous_through_the_dispatcher() -> Iterator[None]:
    """``Tensor.contiguous`` as the ``aten.contiguous`` op. The Python method first sets a device
    guard for the tensor's device, and a CPU-only torch has no guard for CUDA, so on a fake
    CUDA tensor that needs a copy it raises; the op itself is what the method runs next."""
    method = torch.Tensor.contiguous
    torch.Tensor.contiguous = lambda self, memory_format=torch.contiguous_format: torch.ops.aten.contiguous(
        self, memory_format=memory_format)
    try:
        yield
    finally:
        torch.Tensor.contiguous = method


def record(shapes: dict[str, dict]) -> list[Call]:
    """Every Triton launch of ``shapes``' steps (module docstring), with its arguments."""
    source = [""]
    mixed = ([(0, 37), (64, 5)], [17, 200, 1025])
    with (capturing(list(shipped_kernels().values()), source) as calls, FakeTensorMode(), torch.inference_mode(),
          _contiguous_through_the_dispatcher()):
        for name, cfg in shapes.items():
            if "layer_types" not in cfg:  # every layer alike: one is enough
                cfg = {**cfg, "num_hidden_layers": 1}
            runtime = CudaRuntime(CUDA)
            for dtype_name, dtype in runtime.supported_dtypes().items():
                # Soft-capping is float32 arithmetic on the scores in every dtype: it is checked
                # in the default one (CudaRuntime.default_dtype at compute capability >= 8.0).
                for softcap in (0.0, SOFTCAP) if dtype == torch.bfloat16 and name in SOFTCAPPED else (0.0,):
                    model = dummy_model(cfg, dtype, seed=None, attention_backend="triton", runtime=runtime)
                    for m in model.modules():
                        if isinstance(m, Attention):
                            m.softcap = softcap
                    c = model.kv_shape()
                    kv = TokenToKVPool(4096, c.num_layers, c.num_kv_heads, c.head_dim, dtype, CUDA)
                    tag = f"{name} {dtype_name}" + (" softcap" if softcap else "")
                    source[0] = f"{tag} mixed"
                    _step(model, kv, *mixed, per_token=False)
                    source[0] = f"{tag} lora mixed"
                    _lora_step(model, kv, *mixed)
                    make_batch_invariant(model, kernels=runtime.batch_invariant_linears)  # the Triton GEMM and RMSNorm
                    source[0] = f"{tag} deterministic mixed"
                    _step(model, kv, *mixed, per_token=True)
                    source[0] = f"{tag} deterministic decode b=1"
                    _step(model, kv, [], [300], per_token=True)
    return calls


def shipped_kernels() -> dict[str, JITFunction]:
    """Every ``@triton.jit`` kernel the scheduler's kernels define, by name, helpers excluded (a
    helper is a jit function another one calls; it is compiled into its callers)."""
    import services.scheduler.kernels as kernels

    found: dict[str, JITFunction] = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, JITFunction) and value.__module__ == module.__name__:
                found[value.__name__] = value
    called = {n for f in found.values() for n in found if n != f.__name__ and f"{n}(" in f.src}
    return {n: f for n, f in found.items() if n not in called}


def unlaunched(calls: list[Call]) -> list[str]:
    """Names of shipped kernels that no recorded step launched."""
    return sorted(set(shipped_kernels()) - {call.kernel.__name__ for call in calls})
