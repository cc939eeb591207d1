"""Qwen3 dense: the Llama blocks with an RMSNorm over each q and k head before rotary
(``q_norm``/``k_norm``, weight [head_dim]), no q/k/v bias, head_dim from the config."""

from __future__ import annotations

import torch

from services.scheduler.layers.attention_backend import AttentionBackend
from services.scheduler.layers.norm import RMSNorm
from services.scheduler.layers.parallel import TensorParallel
from services.scheduler.models.llama import LlamaAttention, LlamaConfig, LlamaForCausalLM


class QKNormAttention(LlamaAttention):
    """``LlamaAttention`` whose q and k heads are RMS-normalized before rotary (Qwen3, Qwen3-MoE)."""

    def __init__(self, cfg: LlamaConfig, layer_id: int, attn_backend: AttentionBackend,
                 tp: TensorParallel = TensorParallel()):
        super().__init__(cfg, layer_id, attn_backend, tp)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project_qkv(self, h: torch.Tensor) -> torch.Tensor:
        """h: [T, hidden] -> qkv [T, (Hq + 2 Hkv) * D] with q and k heads normalized."""
        qkv = self.qkv_proj(h)
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, self.q_size)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size)
        return torch.cat([q, k, v], dim=-1)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense): ``LlamaForCausalLM`` with ``QKNormAttention``."""

    attention_cls = QKNormAttention
