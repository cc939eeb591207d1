"""Gemma 3 text decoder (``Gemma3ForCausalLM``, Gemma Team 2025) on the paged KV cache.

Built from the shared blocks (``models.blocks``); what differs is Gemma's, following
transformers' ``modeling_gemma3.py``, and ``ModelConfig.from_hf`` reads it:

- RMSNorm scales by ``1 + weight`` and multiplies in float32 before casting back
  (``layers.norm.OffsetRMSNorm``); the checkpoint's ``weight`` is turned into ``1 + weight``
  (float32) at load, so a norm is one multiply.
- q and k are RMSNorm-ed per head (``q_norm``, ``k_norm``) before the rotary embedding.
- Four norms per layer (``SandwichLayer``): input, post-attention, pre-feedforward and
  post-feedforward; the residual adds the *normalized* attention and MLP outputs.
- The embedding is scaled by ``sqrt(hidden_size)`` rounded to the model dtype.
- MLP: GELU with the tanh approximation (``gelu_pytorch_tanh``).
- Attention scale ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``.
- Layers are sliding-window (``layer_types`` "sliding_attention", or every layer but each
  ``sliding_window_pattern``-th) or global ("full_attention"); sliding layers attend to
  the last ``sliding_window`` positions and use the local rotary base
  (``rope_local_base_freq``, 10,000), global ones ``rope_theta`` (1,000,000) with the
  config's rope scaling (``layers.rotary``: "linear" for 4B and larger). The window is
  passed to every attention call of the layer (``attention.paged``); KV rows outside the
  window are kept (the global layers read them).
- Final-logit soft-capping (``final_logit_softcapping``) on the logits (in float32) where
  the config sets it. Attention logit soft-capping: Gemma 3 replaced it by the q/k norms,
  and transformers' ``Gemma3Attention`` never passes ``attn_logit_softcapping`` to its
  attention, so a config that sets it is served as transformers serves it (no capping),
  with a warning that says so; every attention backend implements the capping
  (``softcap``), and ``Attention.softcap`` switches it on for a model that needs it
  (tests/scheduler/test_gemma3.py checks it against transformers' eager ``softcap``).

Refused with a clear error (``models.config``): ``use_bidirectional_attention`` (the
embedding-model variant), an attention bias, and activations or rope types that
transformers' Gemma 3 would not run the same way here.
"""

from __future__ import annotations

import logging

import torch

from services.scheduler.models.base import LayerEnv
from services.scheduler.models.blocks import Attention, GatedMLP, SandwichLayer, activation
from services.scheduler.models.config import ModelConfig
from services.scheduler.models.decoder import DecoderForCausalLM

log = logging.getLogger(__name__)


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3's sandwich-norm layers and (tied) LM head."""

    def __init__(self, cfg: ModelConfig, env: LayerEnv):
        if cfg.attn_logit_softcapping:
            log.warning("config sets attn_logit_softcapping=%s; Gemma 3 does not apply it (neither does "
                        "transformers' Gemma3Attention), so it is ignored", cfg.attn_logit_softcapping)
        super().__init__(cfg, env)

    def make_layer(self, cfg: ModelConfig, layer_id: int, env: LayerEnv) -> SandwichLayer:
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, activation(cfg, env), env)
        return SandwichLayer(cfg, Attention(cfg, layer_id, env), mlp, env)

    def map_checkpoint(self, name: str, tensor: torch.Tensor) -> tuple[str, object, torch.Tensor] | None:
        """As every decoder's, with each norm weight w read as ``1 + w`` in float32."""
        mapped = super().map_checkpoint(name, tensor)
        if mapped is not None and mapped[0].endswith("norm.weight"):
            return mapped[0], mapped[1], tensor.float() + 1.0
        return mapped
