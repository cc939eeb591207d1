"""An architecture-neutral model config: what the engine, the memory sizing and every block read.

``ModelConfig.from_hf`` reads an HF config.json dict of any supported family into one shape:
the dims, per-layer facts (sliding window, rope base and scaling, experts or not), the norm
style, the activation, the attention's q/k norm and scale, soft-capping, tied embeddings and
the MoE routing fields. What a family implies without saying it (Gemma's offset norms and
scaled embedding, Qwen3's q/k norm) is set here from the family, so that no block and no
engine code asks which architecture it serves.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.layers.rotary import rope_type

SLIDING, GLOBAL = "sliding_attention", "full_attention"  # Gemma's layer_types

# HF ``architectures`` name (or, without one, ``model_type``) -> the family whose conventions apply.
FAMILIES = {
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "llama", "Phi3ForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3", "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe", "MixtralForCausalLM": "mixtral",
    "llama": "llama", "mistral": "llama", "phi3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen2_moe", "mixtral": "mixtral",
}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table: base ``theta`` and the rope parameters (``layers.rotary``: rope_type,
    factor, partial_rotary_factor, ...; None for plain RoPE)."""

    theta: float
    scaling: dict | None = None


@dataclass(frozen=True)
class LayerSpec:
    """What differs between a model's layers.

    Attributes:
        sliding_window: W, keys a query sees (its own included); 0 for global attention.
        rope: the layer's rotary table.
        sparse: the MLP is a mixture of experts (else a gated MLP of ``intermediate_size``).
    """

    sliding_window: int
    rope: RopeSpec
    sparse: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only causal LM, whatever its family.

    Attributes:
        architecture: the HF ``architectures`` entry served (names the model class).
        head_dim: D of every attention head.
        norm_style: "rms" (``weight * norm(x)``) or "offset" (``(1 + w) * norm(x)`` in float32, Gemma).
        hidden_act: the gated MLP's activation, "silu" or "gelu_tanh" (``layers.activation``).
        qk_norm: an RMSNorm over each q and k head before rotary (Qwen3, Gemma 3).
        attention_scale: the softmax scale (D ** -0.5, or Gemma's ``query_pre_attn_scalar ** -0.5``).
        embedding_multiplier: the embedding is multiplied by it (Gemma: sqrt(hidden_size)), 1.0 for none.
        attn_logit_softcapping, final_logit_softcapping: tanh caps, 0 for none (Gemma 3 reads
            the first but does not apply it, as transformers' Gemma 3: ``models.gemma3``).
        layers: per layer, its window, rope and MLP kind.
        num_experts .. shared_expert_intermediate_size: MoE routing (0 / False for a dense model).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    layers: tuple[LayerSpec, ...]
    norm_style: str = "rms"
    hidden_act: str = "silu"
    attention_bias: bool = False
    qk_norm: bool = False
    attention_scale: float = 0.0
    embedding_multiplier: float = 1.0
    tie_word_embeddings: bool = False
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Read an HF config dict: rope from ``rope_parameters`` (transformers 5; Gemma's per
        layer type) or ``rope_theta``/``rope_scaling``, with the top-level
        ``partial_rotary_factor`` and ``original_max_position_embeddings`` (Phi-3) folded in.

        Raises:
            ValueError: an architecture no family here serves, an activation other than the
                family's, an active sliding window outside Gemma, an unsupported rope type,
                and Gemma 3's bidirectional attention, attention bias or unknown layer types
                (each named).
        """
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in FAMILIES), None)
        family = FAMILIES.get(arch or hf.get("model_type", ""))
        if family is None:
            raise ValueError(f"unsupported architectures {archs}; supported: "
                             f"{sorted(a for a in FAMILIES if a[0].isupper())}")
        arch = arch or next(a for a, f in FAMILIES.items() if f == family and a[0].isupper())
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        fields = dict(
            architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
            max_position_embeddings=hf["max_position_embeddings"], rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            attention_scale=head_dim**-0.5)
        if family == "gemma3":
            fields |= _gemma3(hf)
        else:
            fields |= _llama(hf, family)
        if family in MOE_FAMILIES:
            fields |= _moe(hf, family, fields["layers"])
        return cls(**fields)

    def is_sparse(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` has experts."""
        return self.layers[layer_id].sparse

    def mlp_activation_width(self) -> int:
        """The widest MLP activation of a layer, per token (elements): 2 I for a gated MLP; for
        a sparse layer the router's logits, the top-k experts' 2 I_moe each and the shared
        expert's 2 I_shared."""
        widths = [self.num_experts + 2 * self.num_experts_per_tok * self.moe_intermediate_size
                  + 2 * self.shared_expert_intermediate_size if spec.sparse else 2 * self.intermediate_size
                  for spec in self.layers]
        return max(widths)

    def check_tensor_parallel(self, size: int) -> None:
        """Refuse a model whose heads or intermediate sizes do not split over ``size`` ranks
        (the vocabulary is padded, so any size fits it; KV heads fewer than ranks are
        replicated when ``size`` is a multiple of them).

        Raises:
            ValueError: naming the size that does not divide and ``--tp-size``.
        """
        if size < 1:
            raise ValueError(f"--tp-size {size} must be >= 1")
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads % size:
            raise ValueError(f"--tp-size {size} does not divide the model's {heads} attention heads")
        if kv >= size and kv % size:
            raise ValueError(f"--tp-size {size} does not divide the model's {kv} KV heads")
        if kv < size and size % kv:
            raise ValueError(f"--tp-size {size} is not a multiple of the model's {kv} KV heads "
                             "(needed to replicate them)")
        sizes = {"intermediate size": self.intermediate_size if not all(s.sparse for s in self.layers) else 0,
                 "MoE intermediate size": self.moe_intermediate_size,
                 "shared expert intermediate size": self.shared_expert_intermediate_size}
        for what, n in sizes.items():
            if n % size:
                raise ValueError(f"--tp-size {size} does not divide the model's {what} {n}")


def _llama(hf: dict, family: str) -> dict:
    """The Llama-like families' fields (Llama, Qwen2, Qwen3, Mistral, Phi-3 and the MoE ones)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; only silu")
    if hf.get("sliding_window") and hf.get("use_sliding_window", True) and \
            hf["sliding_window"] < hf["max_position_embeddings"]:
        raise ValueError("sliding-window attention is not implemented; the config sets sliding_window")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if key in hf and key not in rope:
            rope[key] = hf[key]
    rope_type(rope)  # refuse an unsupported scaling now, by name
    spec = RopeSpec(float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), rope or None)
    return dict(
        layers=tuple(LayerSpec(0, spec) for _ in range(hf["num_hidden_layers"])),
        # Qwen2-MoE names it qkv_bias; both Qwen2 families default to biased q/k/v.
        attention_bias=hf.get("attention_bias", hf.get("qkv_bias", hf.get("model_type") in ("qwen2", "qwen2_moe"))),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=hf.get("tie_word_embeddings", False))


def _gemma3(hf: dict) -> dict:
    """A ``gemma3_text`` config's fields: transformers 5's ``rope_parameters`` per layer type, or
    the older ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``; ``layer_types``, or
    ``sliding_window_pattern`` (default 6: every sixth layer global); sliding layers get the
    window and the local rope, global ones the config's rope scaling."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention is not supported (causal decoders only)")
    if hf.get("attention_bias"):
        raise ValueError("Gemma 3 with attention_bias is not supported")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported Gemma 3 hidden_activation {act!r}; only gelu_pytorch_tanh")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
        types = [SLIDING if (i + 1) % pattern else GLOBAL for i in range(n)]
    unknown = sorted(set(types) - {SLIDING, GLOBAL})
    if unknown or len(types) != n:
        raise ValueError(f"layer_types {types!r}: need {n} entries of {SLIDING!r} / {GLOBAL!r}")
    params = hf.get("rope_parameters") or {}
    full = dict(params.get(GLOBAL) or hf.get("rope_scaling") or {})
    local = dict(params.get(SLIDING) or {})
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    for rope in (full, local):
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported Gemma 3 rope_type {kind!r}; supported: default, linear, llama3")
    ropes = {GLOBAL: RopeSpec(float(full["rope_theta"]), full), SLIDING: RopeSpec(float(local["rope_theta"]), local)}
    window = int(hf.get("sliding_window") or 0)
    return dict(
        layers=tuple(LayerSpec(window if t == SLIDING else 0, ropes[t]) for t in types),
        norm_style="offset", hidden_act="gelu_tanh", qk_norm=True,
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        attention_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        embedding_multiplier=hf["hidden_size"] ** 0.5,
        attn_logit_softcapping=float(hf.get("attn_logit_softcapping") or 0.0),
        final_logit_softcapping=float(hf.get("final_logit_softcapping") or 0.0))


def _moe(hf: dict, family: str, layers: tuple[LayerSpec, ...]) -> dict:
    """Routing fields (names as in the Qwen-MoE configs; Mixtral's ``num_local_experts`` and
    experts of ``intermediate_size`` read into the same names, its top-k always renormalized)
    and which layers are sparse (transformers' rule: not in ``mlp_only_layers``, and
    ``(i + 1) % decoder_sparse_step == 0``; Mixtral's all)."""
    mixtral = family == "mixtral"
    experts = hf.get("num_experts") or hf["num_local_experts"]
    step = hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or ())
    sparse = [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(len(layers))]
    return dict(
        layers=tuple(LayerSpec(s.sliding_window, s.rope, sp) for s, sp in zip(layers, sparse, strict=True)),
        num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["intermediate_size"] if mixtral else hf["moe_intermediate_size"],
        norm_topk_prob=True if mixtral else bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0)
