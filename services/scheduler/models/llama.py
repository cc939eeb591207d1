"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral, Phi-3) on a paged KV cache.

One class covers the family: the variants differ only in config flags (q/k/v bias for
Qwen2, head_dim, grouped-query attention, tied embeddings, RMSNorm eps, rope theta, rope
scaling and partial rotary: ``layers.rotary``). Weights come from an HF directory
(config.json + *.safetensors); q/k/v and gate/up projections are fused at load (Phi-3
ships them fused) so a layer runs four matmuls. Other architectures reuse these blocks:
a subclass names its config (``config_class``), its attention (``attention_cls``) and its
MLP per layer (``make_mlp``): ``models.qwen3`` (q/k norm), ``models.moe`` (experts).

Under tensor parallelism (``layers.parallel``) each rank builds the same modules with its
share of the heads, KV heads, intermediate size and vocabulary, loads its shard of every
weight, and sums the row-parallel o_proj and down_proj outputs with one all-reduce each
(the Llama, Qwen2 and Mistral architectures; the others run unsharded).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from services.scheduler.layers.attention import AttnMetadata, KVBuffers
from services.scheduler.layers.attention_backend import AttentionBackend, create_attention_backend
from services.scheduler.layers.norm import RMSNorm
from services.scheduler.layers.parallel import (TensorParallel, VocabParallelEmbedding, check_divisible, local_kv_heads,
                                                shard_state, vocab_shard_size)
from services.scheduler.layers.rotary import RotaryEmbedding, rope_type, rotary_permutation

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, head_dim]


class _Linear(torch.nn.Linear):
    """``nn.Linear`` without the random init: every weight comes from the checkpoint (or
    ``dummy``). Initializing on the meta device runs torch's reference ops, which import
    torch._dynamo and with it triton (whose bindings then print ~30 "nanobind: leaked"
    lines at every exit of a CPU scheduler)."""

    def reset_parameters(self) -> None:
        pass


class _Embedding(torch.nn.Embedding):
    """``nn.Embedding`` without the random init (see ``_Linear``), for models that run
    unsharded; the Llama family's is ``layers.parallel.VocabParallelEmbedding``."""

    def reset_parameters(self) -> None:
        pass


@dataclass(frozen=True)
class LlamaConfig:
    """The config.json fields the model reads; defaults are Llama's."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    attention_bias: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        """Read an HF config dict; rope from ``rope_parameters`` (transformers 5) or
        ``rope_theta``/``rope_scaling``, with the top-level ``partial_rotary_factor`` and
        ``original_max_position_embeddings`` (Phi-3) folded in.

        Raises:
            ValueError: a hidden activation other than silu, an active sliding window, or an
                unsupported rope type (named).
        """
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu")
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) and cfg["sliding_window"] < cfg["max_position_embeddings"]:
            raise ValueError("sliding-window attention is not implemented; the config sets sliding_window")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        for key in ("partial_rotary_factor", "original_max_position_embeddings"):
            if key in cfg and key not in rope:
                rope[key] = cfg[key]
        rope_type(rope)  # refuse an unsupported scaling now, by name
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        return cls(**cls.fields_from_hf(cfg),
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope or None,
            max_position_embeddings=cfg["max_position_embeddings"],
            # Qwen2-MoE names it qkv_bias; both Qwen2 families default to biased q/k/v.
            attention_bias=cfg.get("attention_bias",
                                   cfg.get("qkv_bias", cfg.get("model_type") in ("qwen2", "qwen2_moe"))),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        )

    @classmethod
    def fields_from_hf(cls, cfg: dict) -> dict:
        """A subclass's own fields from the HF config dict (none here)."""
        return {}


class LlamaAttention(torch.nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int, attn_backend: AttentionBackend,
                 tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.layer_id = layer_id
        self.attn_backend = attn_backend
        self.tp = tp
        self.num_heads = cfg.num_attention_heads // tp.size  # this rank's
        self.num_kv_heads = local_kv_heads(cfg.num_key_value_heads, tp.size)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = _Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = _Linear(self.q_size, cfg.hidden_size, bias=False)

    def project_qkv(self, h: torch.Tensor) -> torch.Tensor:
        """h: [T, hidden] -> qkv [T, (Hq + 2 Hkv) * D], before rotary."""
        return self.qkv_proj(h)

    def forward(self, h: torch.Tensor, rope: Rope, meta: AttnMetadata, kv: KVBuffers) -> torch.Tensor:
        """h: [T, hidden] -> [T, hidden]."""
        qkv = self.project_qkv(h)  # [T, (Hq + 2 Hkv) * D], this rank's heads
        return self.tp.all_reduce(self.o_proj(self.attn_backend.forward_qkv(qkv, rope, self.num_heads, self.layer_id,
                                                                            meta, kv, self.scale)))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 I] (gate, up) -> silu(gate) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class LlamaMLP(torch.nn.Module):
    """The gated MLP: down(silu(gate(h)) * up(h)), gate and up fused; under tensor parallelism
    this rank's columns, the row-parallel down_proj summed over ranks."""

    def __init__(self, cfg: LlamaConfig, tp: TensorParallel = TensorParallel(), intermediate_size: int | None = None):
        super().__init__()
        self.tp = tp
        # this rank's columns; another size than the config's: a MoE's shared expert
        inter = (intermediate_size or cfg.intermediate_size) // tp.size
        self.gate_up_proj = _Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = _Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, act=silu_and_mul) -> torch.Tensor:
        """h: [T, hidden] -> [T, hidden]; ``act`` is SiLU-and-mul (the cpu backend passes its fused kernel)."""
        return self.tp.all_reduce(self.down_proj(act(self.gate_up_proj(h))))


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, attn: LlamaAttention, mlp: torch.nn.Module, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, rope: Rope, meta: AttnMetadata, kv: KVBuffers) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, meta, kv)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(torch.nn.Module):
    """The decoder plus LM head. Built on the meta device; ``load`` materializes it.

    Args:
        attn_backend: the attention every layer calls (``layers.attention_backend``).
        tp: this rank's tensor-parallel group (the whole model when its size is 1).
    """

    # What ``load`` and ``dummy`` read the HF config with; a subclass for another family
    # (``models.gemma3``, ``models.moe``) names its own, and its own ``convert_state``.
    config_class: ClassVar[type[LlamaConfig]] = LlamaConfig
    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention

    def make_mlp(self, cfg: LlamaConfig, layer_id: int) -> torch.nn.Module:
        """The MLP of layer ``layer_id``: its ``forward(h, act)`` maps [T, hidden] -> [T, hidden]."""
        return LlamaMLP(cfg, self.tp)

    def __init__(self, cfg: LlamaConfig, attn_backend: AttentionBackend, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.num_kv_heads = local_kv_heads(cfg.num_key_value_heads, tp.size)  # the KV pool's, on this rank
        self.attn_backend = attn_backend
        with torch.device(attn_backend.device):
            # Real tensors on the model's device even when the module tree is built on the meta device.
            self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = torch.nn.ModuleList(
            LlamaDecoderLayer(self.attention_cls(cfg, i, attn_backend, tp), self.make_mlp(cfg, i), cfg)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = _Linear(cfg.hidden_size, vocab_shard_size(cfg.vocab_size, tp.size), bias=False)

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, attention_backend: str = "auto",
             device: torch.device = torch.device("cpu"), tp: TensorParallel = TensorParallel()) -> "LlamaForCausalLM":
        """Build from ``model_dir``/config.json and every ``*.safetensors`` file in it.

        Args:
            attention_backend: a name for ``create_attention_backend``, resolved for ``device``.
            device: where the weights go; safetensors reads each tensor straight onto it (no
                copy of the whole model on the host first; under tensor parallelism the host
                holds it and the device gets the shard), and tied embeddings stay one tensor.
            tp: keep rank ``tp.rank``'s shard of every weight (``layers.parallel.shard_state``).

        Raises:
            FileNotFoundError: no safetensors file.
            RuntimeError: missing or unexpected weights (named by load_state_dict), or an
                attention backend that cannot run on the weights' device.
            ValueError: an unknown attention backend, or heads / intermediate size that
                ``tp.size`` does not divide.
        """
        cfg = cls.config_class.from_hf(json.loads((model_dir / "config.json").read_text()))
        check_divisible(cfg, tp.size)
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        backend = create_attention_backend(attention_backend, device)
        # Under tensor parallelism the whole checkpoint is read to the host and only this
        # rank's shard goes to the device: the point is a model larger than one device.
        raw: dict[str, torch.Tensor] = {}
        for f in files:
            raw.update(load_file(str(f), device=str(backend.device if tp.size == 1 else "cpu")))
        with torch.device("meta"):
            model = cls(cfg, backend, tp)
        state = shard_state(cls.convert_state(raw, cfg, dtype), cfg, tp, backend.device)
        del raw
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval()

    @classmethod
    def dummy(cls, hf_config: dict, dtype: torch.dtype, seed: int | None = 0, attention_backend: str = "auto",
              device: torch.device = torch.device("cpu"), tp: TensorParallel = TensorParallel()) -> "LlamaForCausalLM":
        """Random weights for an HF config dict, made on ``device``: N(0, 0.02) matrices (as
        HF's ``initializer_range``), unit norms, zero biases; reproducible through ``seed``
        (per device kind; None = torch's global generator). Under tensor parallelism every
        rank draws the whole model and keeps its shard, so the ranks together hold the
        weights of ``tp.size`` 1. ``attention_backend``, ``tp`` and errors as in ``load``."""
        cfg = cls.config_class.from_hf(hf_config)
        check_divisible(cfg, tp.size)
        backend = create_attention_backend(attention_backend, device)
        gen = None if seed is None else torch.Generator(backend.device).manual_seed(seed)
        with torch.device("meta"):
            full, model = cls(cfg, backend), cls(cfg, backend, tp)
        state = {}
        on = dict(dtype=dtype, device=backend.device)
        for name, p in full.named_parameters():
            if name.endswith("norm.weight"):
                state[name] = torch.ones(p.shape, **on)
            elif name.endswith(".bias"):
                state[name] = torch.zeros(p.shape, **on)
            else:
                normal = torch.empty(p.shape, dtype=torch.float32, device=backend.device).normal_(generator=gen)
                state[name] = normal.mul_(0.02).to(dtype)
        if cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        model.load_state_dict(shard_state(state, cfg, tp, backend.device), strict=True, assign=True)
        return model.eval()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, kv: KVBuffers) -> torch.Tensor:
        """input_ids, positions: int64 [T] packed over requests -> final hidden states [T, hidden].

        The attention backend prepares ``meta`` here, once for all layers.
        """
        self.attn_backend.init_forward_metadata(meta)
        h = self.embed_tokens(input_ids)
        rope = self.rotary(positions, h.dtype)
        ops = getattr(self.attn_backend, "cpu_ops", None)
        if ops is not None:
            return self._forward_fused(h, rope, meta, kv, ops)
        for layer in self.layers:
            h = layer(h, rope, meta, kv)
        return h

    def _forward_fused(self, h: torch.Tensor, rope: Rope, meta: AttnMetadata, kv: KVBuffers, ops) -> torch.Tensor:
        """The layers with the cpu backend's fused kernels (``layers.cpu_kernels``): each residual
        add rides on the next RMSNorm, SiLU-and-mul is one kernel. The same roundings as
        ``LlamaDecoderLayer.forward``, in a third of the ops."""
        if self.int8_fused:
            return self._forward_fused_int8(h, rope, meta, kv)
        residual = h  # the embedding's fresh output, updated in place from here on
        norm = self.layers[0].input_layernorm
        x = ops.add_rms_norm(h, norm.weight, norm.eps)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn(x, rope, meta, kv)
            norm = layer.post_attention_layernorm
            x = ops.add_rms_norm(attn, norm.weight, norm.eps, residual)
            mlp = layer.mlp(x, ops.silu_and_mul)  # the row-parallel sum inside (LlamaMLP.forward)
            if i + 1 < len(self.layers):
                norm = self.layers[i + 1].input_layernorm
                x = ops.add_rms_norm(mlp, norm.weight, norm.eps, residual)
        return residual.add_(mlp)

    int8_fused = False  # ``fuse_int8_norms`` turns it on

    def fuse_int8_norms(self) -> bool:
        """Run each RMSNorm and SiLU-and-mul inside the C call of the int8 linear it feeds
        (``_forward_fused_int8``) from now on, if every layer is the plain Llama block with int8
        linears (``layers.quant``) on one rank; returns whether it does."""
        if self.tp.size != 1:
            return False
        from services.scheduler.layers.quant import Int8Linear

        self.int8_fused = all(type(layer.self_attn) is LlamaAttention and type(layer.mlp) is LlamaMLP
                   and all(isinstance(m, Int8Linear) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                               layer.mlp.gate_up_proj, layer.mlp.down_proj))
                   for layer in self.layers)
        return self.int8_fused

    def _forward_fused_int8(self, h: torch.Tensor, rope: Rope, meta: AttnMetadata, kv: KVBuffers) -> torch.Tensor:
        """``_forward_fused`` with int8 linears: each RMSNorm (and its residual add) runs in the
        C call of the linear it feeds, SiLU-and-mul in down_proj's (``Int8Linear.forward``):
        6 calls a layer instead of 9, the same bits."""
        residual, x = h, h  # the embedding's fresh output, updated in place from here on
        norm = self.layers[0].input_layernorm
        pre = (norm.weight, norm.eps, None)  # the first layer normalizes the embedding as it is
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            qkv = attn.qkv_proj(x, norm=pre)
            o = attn.o_proj(self.attn_backend.forward_qkv(qkv, rope, attn.num_heads, attn.layer_id, meta, kv,
                                                          attn.scale))
            post = layer.post_attention_layernorm
            gate_up = layer.mlp.gate_up_proj(o, norm=(post.weight, post.eps, residual))
            x = layer.mlp.down_proj(gate_up, silu_and_mul=True)
            if i + 1 < len(self.layers):
                norm = self.layers[i + 1].input_layernorm
                pre = (norm.weight, norm.eps, residual)
        return residual.add_(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (the positions that sample) -> float32 logits [N, vocab], the
        vocabulary shards gathered from every rank (every rank must call it)."""
        return self.tp.gather_vocab(self.lm_head(self.norm(hidden)).float(), self.config.vocab_size)

    @staticmethod
    def convert_state(raw: dict[str, torch.Tensor], cfg: LlamaConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Checkpoint tensors (HF names) -> this module's state dict in ``dtype`` (``_fuse``)."""
        return _fuse(raw, cfg, dtype)


def _fuse(raw: dict[str, torch.Tensor], cfg: LlamaConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF names -> this module's names, in ``dtype``: q/k/v and every gate/up pair (a shared
    expert's too) concatenated along the output dim (Phi-3's ``qkv_proj`` and ``gate_up_proj``
    come fused and pass through); for partial rotary the q and k rows, and q/k norm weights,
    reordered by ``layers.rotary.rotary_permutation``."""
    perm = rotary_permutation(cfg.head_dim, cfg.rope_scaling)
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        key = name.removeprefix("model.")
        if ".k_proj." in key or ".v_proj." in key or ".up_proj." in key or "rotary_emb" in key:
            continue
        if ".q_proj." in key:
            t = torch.cat([t, raw[name.replace("q_proj", "k_proj")], raw[name.replace("q_proj", "v_proj")]])
            key = key.replace("q_proj", "qkv_proj")
        elif ".gate_proj." in key:
            t = torch.cat([t, raw[name.replace("gate_proj", "up_proj")]])
            key = key.replace("gate_proj", "gate_up_proj")
        if perm is not None and ".qkv_proj." in key:
            t = _permute_qk_rows(t, cfg, perm)
        elif perm is not None and key.endswith(("q_norm.weight", "k_norm.weight")):
            t = t.index_select(0, perm)
        out[key] = t.to(dtype)
    if cfg.tie_word_embeddings or "lm_head.weight" not in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def _permute_qk_rows(qkv: torch.Tensor, cfg: LlamaConfig, perm: torch.Tensor) -> torch.Tensor:
    """Reorder the dims of every q and k head of a fused qkv weight [(Hq + 2 Hkv) D, ...] or bias by ``perm`` [D]."""
    d = cfg.head_dim
    rows = (cfg.num_attention_heads + cfg.num_key_value_heads) * d
    qk = qkv.narrow(0, 0, rows).unflatten(0, (-1, d)).index_select(1, perm.to(qkv.device)).flatten(0, 1)
    return torch.cat([qk, qkv.narrow(0, rows, qkv.shape[0] - rows)])
