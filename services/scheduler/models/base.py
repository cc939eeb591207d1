"""The model contract the engine depends on (``CausalLM``) and what blocks are built with (``LayerEnv``).

The engine, the memory sizing, the CUDA-graph runner and the tensor-parallel worker know a
model only through ``CausalLM``: a forward over the step's packed tensors, the logits of
chosen rows, the KV cache it needs, its tensor-parallel group and its attention backend.
Every architecture (``models.ARCHITECTURES``) is a ``torch.nn.Module`` that satisfies it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from services.scheduler.attention.backends import AttentionBackend
from services.scheduler.attention.paged import AttnMetadata, KVBuffers
from services.scheduler.layers.norm import FusedOps
from services.scheduler.layers.parallel import TensorParallel
from services.scheduler.models.config import ModelConfig

# (x [T, H], w13 [E, 2 I, H], w2 [E, H, I], weights float32 [T, K], ids int64 [T, K], act) -> [T, H]
FusedExperts = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class KVShape:
    """The KV cache a model needs on this rank: K and V of ``num_kv_heads`` x ``head_dim`` per layer."""

    num_layers: int
    num_kv_heads: int  # this rank's (split, or one replicated head)
    head_dim: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        """Bytes one token's K and V take over every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class CausalLM(Protocol):
    """What the engine needs of a model (an ``nn.Module``; see the module docstring).

    Attributes:
        config: the architecture-neutral config it was built from.
        tp: this rank's tensor-parallel group (size 1: the whole model).
        attn_backend: the attention every layer calls (``attention.backends``).
    """

    config: ModelConfig
    tp: TensorParallel
    attn_backend: AttentionBackend

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                 kv: KVBuffers) -> torch.Tensor:
        """input_ids, positions: int64 [T] packed over requests (extend tokens first, then one per
        decoding request) -> final hidden states [T, hidden] (the final norm not applied)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab], gathered over the ranks (every rank calls it)."""

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> the final norm of each row, [N, hidden] in the weights' dtype: the
        last hidden state transformers reports (what embeddings pool). No collective."""

    def kv_shape(self) -> KVShape:
        """The per-layer KV cache this rank's shard reads and writes."""

    def fuse_cpu_linears(self, allowed: bool = True) -> bool:
        """After ``layers.quant.quantize_model`` or the bf16 linears' packing: run each norm inside
        the C linear it feeds, and the layers in one C call, where the layers allow (``allowed``
        False: never); returns whether it does."""

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    def buffers(self) -> Iterator[torch.Tensor]: ...

    def modules(self) -> Iterator[torch.nn.Module]: ...


@dataclass(frozen=True)
class LayerEnv:
    """What a model's blocks take, when they are built, from the device runtime and the backend.

    Attributes:
        tp: this rank's group (column/row-parallel shapes, all-reduces).
        attention: the backend every attention block calls.
        dtype: the weights' dtype (Gemma's norms keep float32 whatever it is).
        device: where the weights and the rotary tables live.
        fused: element-wise C kernels the backend offers (RMSNorm with the residual add,
            SiLU-and-mul), or None for torch ops.
        fused_experts: the grouped-GEMM expert kernel (``kernels.triton_moe``), or None for the
            CPU expert path (``layers.moe.fused_experts_cpu``).
    """

    tp: TensorParallel
    attention: AttentionBackend
    dtype: torch.dtype
    device: torch.device
    fused: FusedOps | None = None
    fused_experts: FusedExperts | None = None
