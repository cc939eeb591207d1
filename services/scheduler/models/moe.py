"""Mixture-of-experts decoders on the Llama layers: Qwen3-MoE, Qwen2-MoE and Mixtral.

A sparse layer's MLP (``ModelConfig.is_sparse``) is ``models.blocks.SparseMoeBlock``: a
router, the top-k experts of each token as grouped matmuls over weights stacked at load
into [E, ...] tensors, and Qwen2-MoE's sigmoid-gated shared expert. The other layers keep a
dense MLP of ``intermediate_size``. Which layers are sparse, and the routing, follow
transformers (``models.config``). Qwen3-MoE has q/k norm attention, Qwen2-MoE biased q/k/v.
"""

from __future__ import annotations

import re

import torch

from services.scheduler.models.base import LayerEnv
from services.scheduler.models.blocks import SparseMoeBlock
from services.scheduler.models.config import ModelConfig
from services.scheduler.models.llama import LlamaForCausalLM

# model.layers.{i}.{mlp|block_sparse_moe}.experts.{e}.{proj}.weight (per-expert checkpoints)
_EXPERT = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# transformers 5's own stacked names: experts.gate_up_proj [E, 2 I, H] and experts.down_proj [E, H, I]
_STACKED = re.compile(r"\.mlp\.experts\.(gate_up|down)_proj$")


class MoeForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` whose sparse layers hold a ``SparseMoeBlock``."""

    def make_mlp(self, cfg: ModelConfig, layer_id: int, env: LayerEnv) -> torch.nn.Module:
        if cfg.is_sparse(layer_id):
            return SparseMoeBlock(cfg, env)
        return super().make_mlp(cfg, layer_id, env)

    def map_checkpoint(self, name: str, tensor: torch.Tensor) -> tuple[str, object, torch.Tensor] | None:
        """Per-expert tensors (Qwen ``gate/up/down_proj``, Mixtral ``w1/w3/w2``) into the stacked
        ``experts.gate_up`` / ``experts.down`` with their (expert, part); the stacked names whole;
        Mixtral's ``block_sparse_moe`` read as ``mlp``; the rest as ``LlamaForCausalLM``."""
        m = _EXPERT.match(name)
        if m:
            part = _PART[m[3]]
            return (f"layers.{m[1]}.mlp.experts.{'down' if part == 'down' else 'gate_up'}", (int(m[2]), part),
                    tensor)
        name = _STACKED.sub(r".mlp.experts.\1", name.replace(".block_sparse_moe.", ".mlp."))
        if ".mlp.experts." in name:
            return name.removeprefix("model."), None, tensor
        return super().map_checkpoint(name, tensor)
