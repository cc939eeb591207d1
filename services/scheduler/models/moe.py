"""Mixture-of-experts decoders on the Llama blocks: Qwen3-MoE, Qwen2-MoE and Mixtral.

A sparse layer's MLP is a router (``gate``: hidden -> E logits), the top-k experts of each
token (``layers.moe.select_experts``: softmax, top k, renormalized as the config says) and
the experts as grouped matmuls over weights stacked at load into [E, ...] tensors: on the
CPU the tokens sorted by expert (``layers.moe.fused_experts_cpu``), on CUDA the Triton
grouped GEMM (``layers.triton_moe``), picked by the weights' device. Qwen2-MoE adds a
shared expert, a gated MLP on every token scaled by sigmoid(shared_expert_gate(h)).

Which layers are sparse follows transformers: layer i is sparse unless it is in
``mlp_only_layers``, and only when ``(i + 1) % decoder_sparse_step == 0`` (Qwen families);
Mixtral's layers are all sparse. The other layers keep a dense MLP of ``intermediate_size``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from services.scheduler.layers.batch_invariant import RowWindow
from services.scheduler.layers.linear import can_pack, pack_weight, packed_linear
from services.scheduler.layers.moe import ExpertMLP, fused_experts_cpu, select_experts, stacked_expert
from services.scheduler.models.llama import LlamaConfig, LlamaForCausalLM, LlamaMLP, _Linear, silu_and_mul
from services.scheduler.models.qwen3 import QKNormAttention

# model.layers.{i}.{mlp|block_sparse_moe}.experts.{e}.{proj}.weight (per-expert checkpoints)
_EXPERT = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


@dataclass(frozen=True)
class MoeConfig(LlamaConfig):
    """``LlamaConfig`` plus the routing fields (names as in the Qwen-MoE configs)."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def fields_from_hf(cls, cfg: dict) -> dict:
        """Routing fields; Mixtral's (``num_local_experts``, experts of ``intermediate_size``)
        read into the same names, with its top-k always renormalized."""
        mixtral = cfg.get("model_type") == "mixtral"
        return dict(
            num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"],
            norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
            decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )

    def is_sparse(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` has experts (transformers' rule, see the module docstring)."""
        return (layer_id not in self.mlp_only_layers and self.num_experts > 0
                and (layer_id + 1) % self.decoder_sparse_step == 0)


class Experts(torch.nn.Module):
    """Stacked expert weights: ``gate_up`` [E, 2 I, H] (gate rows, then up rows), ``down`` [E, H, I].

    On the CPU in bf16, ``pack`` (called by ``layers.linear.pack_linears``) also holds each
    expert's two weights in oneDNN's blocked layout, as ``PackedLinear`` does for dense layers
    (the stacked tensors stay: the Triton path and ``state_dict`` read them). For
    deterministic inference ``layers.batch_invariant`` probes ``linear_shapes`` and sets
    ``window``: an expert's rows run only at the row counts it measured (``RowWindow``), so a
    token's bits do not depend on how many others chose the same expert.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up = torch.nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size),
                                          requires_grad=False)
        self.down = torch.nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.window: RowWindow | None = None

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in_features, out_features) of each expert's two matmuls: gate_up, then down."""
        e, two_i, h = self.gate_up.shape
        return [(h, two_i), (two_i // 2, h)]

    def pack(self) -> int:
        """Pack every expert's weights for oneDNN if ``layers.linear.can_pack`` allows; returns how many."""
        if self.packed is not None or not can_pack(self.gate_up):
            return 0
        self.packed = [(pack_weight(self.gate_up.select(0, e)), pack_weight(self.down.select(0, e)))
                       for e in range(self.num_experts)]
        return 2 * self.num_experts

    def mlp(self, act) -> ExpertMLP:
        """(e, rows [N, H]) -> down_e(act(gate_up_e(rows))) [N, H], on the packed weights when packed."""
        if self.packed is None:
            run = stacked_expert(self.gate_up, self.down, act)
        else:
            packed = self.packed

            def run(e: int, rows: torch.Tensor) -> torch.Tensor:
                return packed_linear(act(packed_linear(rows, packed[e][0])), packed[e][1])
        window = self.window
        if window is None:
            return run
        return lambda e, rows: window.apply(lambda part: run(e, part), rows)


class SparseMoeBlock(torch.nn.Module):
    """Router, top-k experts and an optional gated shared expert.

    Args:
        device: the weights' device: CUDA runs the Triton grouped GEMM
            (``layers.triton_moe.fused_experts``), anything else the CPU path
            (``layers.moe.fused_experts_cpu``).
    """

    def __init__(self, cfg: MoeConfig, device: torch.device):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.gate = _Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = _Linear(cfg.hidden_size, 1, bias=False)
        self.fused_experts = None  # the CUDA path's; None runs the CPU path
        if torch.device(device).type == "cuda":
            from services.scheduler.layers import triton_moe  # triton only where it runs

            self.fused_experts = triton_moe.fused_experts

    def forward(self, h: torch.Tensor, act=silu_and_mul) -> torch.Tensor:
        """h: [T, hidden] -> [T, hidden]; ``act`` as in ``LlamaMLP.forward``."""
        weights, ids = select_experts(self.gate(h), self.top_k, self.renormalize)  # float32 [T, K], int64 [T, K]
        if self.fused_experts is None:
            out = fused_experts_cpu(h, weights, ids, self.experts.num_experts, self.experts.mlp(act))
        else:
            out = self.fused_experts(h, self.experts.gate_up, self.experts.down, weights, ids, act)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h, act)
        return out


class MoeForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` whose sparse layers (``MoeConfig.is_sparse``) hold a ``SparseMoeBlock``."""

    config_class = MoeConfig

    def make_mlp(self, cfg: MoeConfig, layer_id: int) -> torch.nn.Module:
        if cfg.is_sparse(layer_id):
            return SparseMoeBlock(cfg, self.attn_backend.device)
        return super().make_mlp(cfg, layer_id)

    @classmethod
    def convert_state(cls, raw: dict[str, torch.Tensor], cfg: MoeConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Per-expert tensors (Qwen ``gate/up/down_proj``, Mixtral ``w1/w3/w2``) stacked into
        ``experts.gate_up`` [E, 2 I, H] and ``experts.down`` [E, H, I]; transformers 5's own
        stacked names (``experts.gate_up_proj``/``down_proj``) renamed; Mixtral's
        ``block_sparse_moe`` read as ``mlp``; the rest as ``LlamaForCausalLM``.

        Raises:
            ValueError: a sparse layer with experts missing (named).
        """
        parts: dict[int, dict[tuple[int, str], torch.Tensor]] = {}
        rest: dict[str, torch.Tensor] = {}
        for name, t in raw.items():
            m = _EXPERT.match(name)
            if m:
                parts.setdefault(int(m[1]), {})[int(m[2]), _PART[m[3]]] = t
                continue
            name = name.replace(".block_sparse_moe.", ".mlp.")
            name = re.sub(r"\.mlp\.experts\.(gate_up|down)_proj$", r".mlp.experts.\1", name)
            rest[name] = t
        out = super().convert_state(rest, cfg, dtype)
        for layer, p in parts.items():
            missing = [f"{e}.{k}" for e in range(cfg.num_experts) for k in ("gate", "up", "down") if (e, k) not in p]
            if missing:
                raise ValueError(f"layer {layer}: expert weights missing: {', '.join(missing[:6])}")
            experts = range(cfg.num_experts)
            out[f"layers.{layer}.mlp.experts.gate_up"] = torch.stack(
                [torch.cat([p[e, "gate"], p[e, "up"]]) for e in experts]).to(dtype)
            out[f"layers.{layer}.mlp.experts.down"] = torch.stack([p[e, "down"] for e in experts]).to(dtype)
        return out


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE: q/k norm attention (``models.qwen3``), experts, top-k renormalized when ``norm_topk_prob``."""

    attention_cls = QKNormAttention


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE): biased q/k/v, experts plus a sigmoid-gated shared expert."""


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: experts in every layer, top-k of the softmax always renormalized."""
