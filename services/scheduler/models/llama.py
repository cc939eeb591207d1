"""Llama-family decoders (Llama 2/3, SmolLM2, Qwen2, Qwen3, Mistral, Phi-3) on a paged KV cache.

One class covers the family: the variants differ only in config facts that ``ModelConfig``
carries (q/k/v bias for Qwen2, q/k norm for Qwen3, head_dim, grouped-query attention, tied
embeddings, RMSNorm eps, rope theta, rope scaling and partial rotary: ``layers.rotary``).
A layer is pre-norm attention and a gated SiLU MLP (``models.blocks``); q/k/v and gate/up
load into one fused projection each (Phi-3 ships them fused), so a layer runs four matmuls.
``models.moe`` puts experts in its sparse layers.

Under tensor parallelism each rank builds the same modules with its share of the heads, KV
heads, intermediate size and vocabulary, and each linear loads its shard of the checkpoint
(``layers.parallel_linear``).
"""

from __future__ import annotations

import torch

from services.scheduler.models.base import LayerEnv
from services.scheduler.models.blocks import Attention, GatedMLP, PreNormLayer, activation
from services.scheduler.models.config import ModelConfig
from services.scheduler.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Pre-norm layers of ``Attention`` and ``make_mlp``'s MLP."""

    def make_layer(self, cfg: ModelConfig, layer_id: int, env: LayerEnv) -> PreNormLayer:
        return PreNormLayer(cfg, Attention(cfg, layer_id, env), self.make_mlp(cfg, layer_id, env), env)

    def make_mlp(self, cfg: ModelConfig, layer_id: int, env: LayerEnv) -> torch.nn.Module:
        """Layer ``layer_id``'s MLP, [T, hidden] -> [T, hidden]: a gated MLP of ``intermediate_size``."""
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, activation(cfg, env), env)
