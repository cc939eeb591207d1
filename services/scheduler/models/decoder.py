"""The decoder every architecture shares: embedding, decoder layers, final norm and LM head.

``DecoderForCausalLM`` implements ``models.base.CausalLM`` for any ``ModelConfig``; an
architecture (``models.llama``, ``models.moe``, ``models.gemma3``) names its decoder layer
(``make_layer``, composed of ``models.blocks``) and how its checkpoint's tensor names map to
this module's parameters (``map_checkpoint``: nano-vllm's ``packed_modules_mapping``, plus
the family's conversions). Loading and random weights are ``models.loader``'s.

Rotary tables are one per distinct (base, scaling) among the layers (Gemma 3: a local and a
global one), computed once per step and handed to each layer.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from services.scheduler.attention.paged import AttnMetadata, KVBuffers
from services.scheduler.layers.cpu_linear import CpuLinear
from services.scheduler.layers.parallel import local_kv_heads
from services.scheduler.layers.parallel_linear import ParallelLMHead, VocabParallelEmbedding
from services.scheduler.layers.rotary import RotaryEmbedding
from services.scheduler.models.base import KVShape, LayerEnv
from services.scheduler.models.blocks import Attention, GatedMLP, PreNormLayer, Rope, make_norm
from services.scheduler.models.config import ModelConfig, RopeSpec
from services.scheduler.models.layer_stack import LayerStack, layer_linears


class DecoderForCausalLM(torch.nn.Module):
    """A decoder-only LM on the paged KV cache, built on this rank's device with its shard's
    shapes; ``models.loader`` fills the weights.

    Args:
        cfg: the model.
        env: tensor-parallel group, attention backend, dtype and kernels (``LayerEnv``).
    """

    # Checkpoint module name -> (this module's fused parameter, the part it fills).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, object]]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, env: LayerEnv):
        super().__init__()
        self.config = cfg
        self.tp = env.tp
        self.attn_backend = env.attention
        self.fused = env.fused
        ropes: list[RopeSpec] = []
        for spec in cfg.layers:
            if spec.rope not in ropes:
                ropes.append(spec.rope)
        self.rotaries = torch.nn.ModuleList(
            RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, r.theta, r.scaling) for r in ropes)
        self.layer_rope = [ropes.index(spec.rope) for spec in cfg.layers]
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, env.tp, env.dtype)
        self.layers = torch.nn.ModuleList(self.make_layer(cfg, i, env) for i in range(cfg.num_hidden_layers))
        self.norm = make_norm(cfg, cfg.hidden_size, env)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, env.tp, env.dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.embed_tokens)
        # transformers multiplies the embedding by its multiplier cast to the weights' dtype
        # (bf16 rounds it); host floats per dtype, made here so the forward builds no tensor.
        self.embed_scale = None if cfg.embedding_multiplier == 1.0 else {
            dt: torch.tensor(cfg.embedding_multiplier, dtype=dt, device="cpu").item()
            for dt in (torch.float32, torch.bfloat16, torch.float16)}
        self.cpu_fused = False
        self.layer_stack = LayerStack(self)

    def make_layer(self, cfg: ModelConfig, layer_id: int, env: LayerEnv) -> torch.nn.Module:
        """Decoder layer ``layer_id``: ``forward(x, residual, rope, meta, kv) -> (x, residual)``
        (``models.blocks.PreNormLayer``)."""
        raise NotImplementedError

    def kv_shape(self) -> KVShape:
        cfg = self.config
        return KVShape(cfg.num_hidden_layers, local_kv_heads(cfg.num_key_value_heads, self.tp.size), cfg.head_dim,
                       self.embed_tokens.weight.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                kv: KVBuffers) -> torch.Tensor:
        """input_ids, positions: int64 [T] packed over requests -> final hidden states [T, hidden].

        The attention backend prepares ``meta`` here, once for all layers.
        """
        self.attn_backend.init_forward_metadata(meta)
        h = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale[h.dtype]
        ropes = [rotary(positions, h.dtype) for rotary in self.rotaries]
        if self.cpu_fused:
            return self._forward_fused(h, ropes, meta, kv)
        x, residual = h, None
        for layer, r in zip(self.layers, self.layer_rope, strict=True):
            x, residual = layer(x, residual, ropes[r], meta, kv)
        return residual.add_(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (the positions that sample) -> float32 logits [N, vocab], the
        vocabulary shards gathered from every rank (every rank must call it), soft-capped (in
        float32) where the config says."""
        logits = self.tp.gather_vocab(self.lm_head(self.norm(hidden)).float(), self.config.vocab_size)
        cap = self.config.final_logit_softcapping
        if cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> the final norm of each row (``CausalLM.final_norm``)."""
        return self.norm(hidden)

    def map_checkpoint(self, name: str, tensor: torch.Tensor) -> tuple[str, object, torch.Tensor] | None:
        """A checkpoint tensor (HF name) -> (this module's parameter name, the part it fills, the
        tensor), or None for one that is not loaded (rotary caches; a tied LM head's copy)."""
        name = name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None
        for source, (target, part) in self.packed_modules_mapping.items():
            if f".{source}." in name:
                return name.replace(f".{source}.", f".{target}."), part, tensor
        return name, None, tensor

    def finish_load(self, loaded: set[str]) -> None:
        """After loading: a checkpoint without an LM head ties it to the embedding."""
        if "lm_head.weight" not in loaded:
            self.lm_head.tie(self.embed_tokens)

    def fuse_cpu_linears(self, allowed: bool = True) -> bool:
        """Run each RMSNorm and SiLU-and-mul inside the C call of the linear it feeds, and where
        the step allows all the layers in one C call (``_forward_fused``), from now on, if every
        layer is a pre-norm layer with a plain attention (no q/k norm) and gated SiLU MLP whose
        linears are the C library's (``layers.cpu_linear``: int8, or bf16 on AMX), on one rank
        with the cpu backend's kernels; returns whether it does. ``allowed`` False: never (LoRA
        will wrap the linears), and a fusion made before is undone."""
        self.cpu_fused = (allowed and self.tp.size == 1 and self.config.norm_style == "rms"
                          and all(self._fusable(layer) for layer in self.layers))
        return self.cpu_fused

    def _fusable(self, layer: torch.nn.Module) -> bool:
        """A pre-norm layer with a plain attention and a gated SiLU MLP whose linears are the C library's."""
        ops = self.fused
        return (ops is not None and type(layer) is PreNormLayer and type(layer.mlp) is GatedMLP
                and type(layer.self_attn) is Attention and layer.self_attn.q_norm is None
                and layer.mlp.act is ops.silu_and_mul
                and all(isinstance(m, CpuLinear) for m in layer_linears(layer)))

    def _forward_fused(self, h: torch.Tensor, ropes: list[Rope], meta: AttnMetadata, kv: KVBuffers) -> torch.Tensor:
        """The pre-norm layers with C linears: all of them in one C call where the step's
        attention allows (``models.layer_stack``), else ``_fused_layers``; the same bits."""
        x = self.layer_stack.forward(h, ropes, meta, kv)
        if x is None:
            x = self._fused_layers(h, ropes, meta, kv)
        return h.add_(x)

    def _fused_layers(self, h: torch.Tensor, ropes: list[Rope], meta: AttnMetadata, kv: KVBuffers) -> torch.Tensor:
        """The pre-norm layers with C linears from Python: each RMSNorm (and its residual add)
        runs in the C call of the linear it feeds, SiLU-and-mul in down_proj's
        (``CpuLinear.forward``): 6 calls a layer instead of 9, the same bits. h [T, hidden], the
        embedding's output, becomes the residual stream (updated in place); returns the last
        layer's output."""
        residual, x = h, h  # the embedding's fresh output, updated in place from here on
        norm = self.layers[0].input_layernorm
        pre = (norm.weight, norm.eps, None)  # the first layer normalizes the embedding as it is
        for i, (layer, r) in enumerate(zip(self.layers, self.layer_rope, strict=True)):
            attn = layer.self_attn
            o = attn.o_proj(attn.attend(attn.qkv_proj(x, norm=pre), ropes[r], meta, kv))
            post = layer.post_attention_layernorm
            gate_up = layer.mlp.gate_up_proj(o, norm=(post.weight, post.eps, residual))
            x = layer.mlp.down_proj(gate_up, silu_and_mul=True)
            if i + 1 < len(self.layers):
                norm = self.layers[i + 1].input_layernorm
                pre = (norm.weight, norm.eps, residual)
        return x

    def _apply(self, fn, recurse=True):
        self.layer_stack.forget()  # the tensors it points at may move
        return super()._apply(fn, recurse)
