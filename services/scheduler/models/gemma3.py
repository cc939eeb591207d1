"""Gemma 3 text decoder (``Gemma3ForCausalLM``, Gemma Team 2025) on the paged KV cache.

Built from the Llama blocks of ``models.llama`` (fused q/k/v and gate/up projections, the
attention backends, loading and dummy weights); what differs is Gemma's, following
transformers' ``modeling_gemma3.py``:

- RMSNorm scales by ``1 + weight`` and multiplies in float32 before casting back
  (``Gemma3RMSNorm``); the checkpoint's ``weight`` is turned into ``1 + weight`` (float32)
  at load, so a norm is one multiply.
- q and k are RMSNorm-ed per head (``q_norm``, ``k_norm``) before the rotary embedding.
- Four norms per layer: input, post-attention, pre-feedforward and post-feedforward; the
  residual adds the *normalized* attention and MLP outputs.
- The embedding is scaled by ``sqrt(hidden_size)`` rounded to the model dtype.
- MLP: GELU with the tanh approximation (``gelu_pytorch_tanh``).
- Attention scale ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``.
- Layers are sliding-window (``layer_types`` "sliding_attention", or every layer but each
  ``sliding_window_pattern``-th) or global ("full_attention"); sliding layers attend to
  the last ``sliding_window`` positions and use the local rotary base
  (``rope_local_base_freq``, 10,000), global ones ``rope_theta`` (1,000,000) with the
  config's rope scaling. The window is passed to every attention call of the layer
  (``layers.attention``); KV rows outside the window are kept (the global layers read them).
- Final-logit soft-capping (``final_logit_softcapping``) on the logits (in float32) where
  the config sets it. Attention logit soft-capping: Gemma 3 replaced it by the q/k norms,
  and transformers' ``Gemma3Attention`` never passes ``attn_logit_softcapping`` to its
  attention, so a config that sets it is served as transformers serves it (no capping),
  with a warning that says so; every attention backend implements the capping
  (``softcap``), and ``Gemma3Attention.softcap`` switches it on for a model that needs it
  (tests/scheduler/test_gemma3.py checks it against transformers' eager ``softcap``).

Refused with a clear error: ``use_bidirectional_attention`` (the embedding-model variant),
an attention bias, and activations or rope types that transformers' Gemma 3 would not run
the same way here.
"""

from __future__ import annotations

from dataclasses import dataclass

import logging

import torch
import torch.nn.functional as F

from services.scheduler.layers.attention import AttnMetadata, KVBuffers
from services.scheduler.layers.attention_backend import AttentionBackend
from services.scheduler.layers.norm import RMSNorm
from services.scheduler.layers.rotary import RotaryEmbedding
from services.scheduler.layers.parallel import TensorParallel
from services.scheduler.models.llama import (LlamaAttention, LlamaConfig, LlamaForCausalLM, LlamaMLP, Rope,
                                             _Embedding, _fuse, _Linear)

SLIDING, GLOBAL = "sliding_attention", "full_attention"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
    """The config.json fields Gemma 3 reads beyond Llama's.

    Attributes:
        query_pre_attn_scalar: attention scale is its inverse square root.
        sliding_window: W, tokens a sliding layer sees (its own position included); 0 for none.
        layer_types: per layer, "sliding_attention" or "full_attention".
        rope_local_theta, rope_local_scaling: the sliding layers' rotary base and parameters
            (``rope_theta``/``rope_scaling`` are the global layers').
        attn_logit_softcapping, final_logit_softcapping: tanh caps, 0 for none (the first is
            read but not applied, as transformers' Gemma 3; see the module docstring).
    """

    query_pre_attn_scalar: float = 256.0
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float = 10000.0
    rope_local_scaling: dict | None = None
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0

    @classmethod
    def from_hf(cls, cfg: dict) -> "Gemma3Config":
        """Read a ``gemma3_text`` config dict: transformers 5's ``rope_parameters`` per layer type,
        or the older ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``; ``layer_types``,
        or ``sliding_window_pattern`` (default 6: every sixth layer global).

        Raises:
            ValueError: bidirectional attention, an attention bias, an activation other than
                gelu_pytorch_tanh, an unknown layer type, or a rope type other than default,
                linear or llama3 (each named).
        """
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("Gemma 3 with use_bidirectional_attention is not supported (causal decoders only)")
        if cfg.get("attention_bias"):
            raise ValueError("Gemma 3 with attention_bias is not supported")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported Gemma 3 hidden_activation {act!r}; only gelu_pytorch_tanh")
        layers = cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        if types is None:
            pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
            types = [SLIDING if (i + 1) % pattern else GLOBAL for i in range(layers)]
        unknown = sorted(set(types) - {SLIDING, GLOBAL})
        if unknown or len(types) != layers:
            raise ValueError(f"layer_types {types!r}: need {layers} entries of {SLIDING!r} / {GLOBAL!r}")
        params = cfg.get("rope_parameters") or {}
        full = dict(params.get(GLOBAL) or cfg.get("rope_scaling") or {})
        local = dict(params.get(SLIDING) or {})
        full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
        for rope in (full, local):
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise ValueError(f"unsupported Gemma 3 rope_type {kind!r}; supported: default, linear, llama3")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(full["rope_theta"]),
            rope_scaling=full,
            max_position_embeddings=cfg["max_position_embeddings"],
            attention_bias=False,
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            sliding_window=int(cfg.get("sliding_window") or 0),
            layer_types=tuple(types),
            rope_local_theta=float(local["rope_theta"]),
            rope_local_scaling=local,
            attn_logit_softcapping=float(cfg.get("attn_logit_softcapping") or 0.0),
            final_logit_softcapping=float(cfg.get("final_logit_softcapping") or 0.0),
        )


class Gemma3RMSNorm(RMSNorm):
    """``x / rms(x) * (1 + w)`` in float32, cast back to x's dtype (transformers' ``Gemma3RMSNorm``).

    ``weight`` holds ``1 + w`` (``Gemma3ForCausalLM.convert_state`` adds the one at load),
    kept in float32 whatever the model dtype. x: [..., dim] -> same shape and dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), self.weight.shape, eps=self.eps) * self.weight).to(x.dtype)


def _rotary(head_dim: int, max_positions: int, rope: dict) -> RotaryEmbedding:
    """The cos/sin tables of one layer type (``rope``: its rope parameters with ``rope_theta``).

    "linear" scaling (Gemma 3 4B and larger, global layers) divides the inverse frequencies
    by ``factor``, as transformers' ``_compute_linear_scaling_rope_parameters``; default and
    llama3 go through ``layers.rotary``."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "linear":
        return RotaryEmbedding(head_dim, max_positions, rope["rope_theta"], rope)
    table = RotaryEmbedding(head_dim, max_positions, rope["rope_theta"], None)
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq / rope["factor"])
    emb = torch.cat((freqs, freqs), dim=-1)
    table.cos, table.sin = emb.cos(), emb.sin()
    return table


class Gemma3Attention(LlamaAttention):
    """Llama's fused-qkv attention with per-head q/k RMSNorm, Gemma's scale and the layer's
    sliding window (0 on global layers). ``softcap`` (attention logit soft-capping) is 0:
    Gemma 3 does not cap (see the module docstring)."""

    def __init__(self, cfg: Gemma3Config, layer_id: int, attn_backend: AttentionBackend):
        super().__init__(cfg, layer_id, attn_backend)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.sliding = cfg.layer_types[layer_id] == SLIDING
        self.window = cfg.sliding_window if self.sliding else 0
        self.softcap = 0.0
        self.q_norm = Gemma3RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, rope: Rope, meta: AttnMetadata, kv: KVBuffers) -> torch.Tensor:
        """h: [T, hidden] -> [T, hidden]."""
        qkv = self.qkv_proj(h)  # [T, (Hq + 2 Hkv) * D]
        t, d = qkv.shape[0], self.head_dim
        heads = self.num_heads + self.num_kv_heads
        qk, v = qkv.split([heads * d, self.kv_size], dim=-1)
        # Both norms in one op over the q and k heads side by side.
        weight = torch.cat((self.q_norm.weight.expand(self.num_heads, d), self.k_norm.weight.expand(self.num_kv_heads, d)))
        qk = (F.rms_norm(qk.reshape(t, heads, d).float(), (d,), eps=self.q_norm.eps) * weight).to(qkv.dtype)
        qkv = torch.cat((qk.view(t, heads * d), v), dim=-1)
        out = self.attn_backend.forward_qkv(qkv, rope, self.num_heads, self.layer_id, meta, kv, self.scale,
                                            self.window, self.softcap)
        return self.o_proj(out)


class Gemma3MLP(LlamaMLP):
    """gate/up fused as Llama's; GELU (tanh approximation) instead of SiLU."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: Gemma3Config, layer_id: int, attn_backend: AttentionBackend):
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer_id, attn_backend)
        self.mlp = Gemma3MLP(cfg)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Gemma3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(self, h: torch.Tensor, ropes: dict[bool, Rope], meta: AttnMetadata, kv: KVBuffers) -> torch.Tensor:
        """h: [T, hidden] -> [T, hidden]; ``ropes[sliding]`` is this layer type's (cos, sin)."""
        attn = self.self_attn(self.input_layernorm(h), ropes[self.self_attn.sliding], meta, kv)
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's decoder and (tied) LM head; ``load``/``dummy`` as ``LlamaForCausalLM``'s."""

    config_class = Gemma3Config

    def __init__(self, cfg: Gemma3Config, attn_backend: AttentionBackend, tp: TensorParallel = TensorParallel()):
        torch.nn.Module.__init__(self)
        if tp.size > 1:
            raise ValueError("Gemma3ForCausalLM does not shard over tensor parallelism yet: use --tp-size 1")
        self.tp = tp
        if cfg.attn_logit_softcapping:
            log.warning("config sets attn_logit_softcapping=%s; Gemma 3 does not apply it (neither does "
                        "transformers' Gemma3Attention), so it is ignored", cfg.attn_logit_softcapping)
        self.config = cfg
        self.attn_backend = attn_backend
        with torch.device(attn_backend.device):
            self.rotary = _rotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_scaling)
            self.rotary_local = _rotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_scaling)
        self.embed_tokens = _Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = torch.nn.ModuleList(Gemma3DecoderLayer(cfg, i, attn_backend) for i in range(cfg.num_hidden_layers))
        self.norm = Gemma3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = _Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # transformers multiplies the embedding by sqrt(hidden) cast to the weights' dtype
        # (bf16 rounds it); host floats per dtype, made here so the forward builds no tensor.
        self.embed_scale = {dt: torch.tensor(cfg.hidden_size**0.5, dtype=dt, device="cpu").item()
                            for dt in (torch.float32, torch.bfloat16, torch.float16)}

    @staticmethod
    def convert_state(raw: dict[str, torch.Tensor], cfg: Gemma3Config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """As Llama's (``_fuse``), then every norm weight w becomes ``1 + w`` in float32."""
        out = _fuse(raw, cfg, dtype)
        for name in out:
            if name.endswith("norm.weight"):
                source = raw.get(f"model.{name}", raw.get(name))
                out[name] = source.float() + 1.0
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, kv: KVBuffers) -> torch.Tensor:
        """input_ids, positions: int64 [T] packed over requests -> final hidden states [T, hidden]."""
        self.attn_backend.init_forward_metadata(meta)
        h = self.embed_tokens(input_ids)
        h = h * self.embed_scale[h.dtype]
        kinds = set(self.config.layer_types)
        ropes = {}
        if GLOBAL in kinds:
            ropes[False] = self.rotary(positions, h.dtype)
        if SLIDING in kinds:
            ropes[True] = self.rotary_local(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, ropes, meta, kv)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab], soft-capped (in float32) where the config says."""
        logits = self.lm_head(self.norm(hidden)).float()
        cap = self.config.final_logit_softcapping
        if cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits
