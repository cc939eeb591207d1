"""The blocks every architecture composes: attention, gated MLP, MoE MLP and two decoder layers.

Each block is built from a ``ModelConfig`` and a ``LayerEnv`` (tensor-parallel group,
attention backend, dtype, the backend's fused kernels): its linears are this rank's shard
(``layers.parallel_linear``), and a block whose last linear is row-parallel sums its output
over the ranks itself.

Decoder layers pass ``(x, residual)``: the hidden state is ``residual + x`` (``x`` alone
before the first layer), so a pre-norm layer can add the residual inside its next norm
(``RMSNorm.add``) and the model adds the last block's output once, at the end.
"""

from __future__ import annotations

import torch

from services.scheduler.attention.paged import AttnMetadata, KVBuffers
from services.scheduler.layers.activation import ACTIVATIONS, Activation
from services.scheduler.layers.moe import Experts, fused_experts_cpu, select_experts
from services.scheduler.layers.norm import NORMS, RMSNorm
from services.scheduler.layers.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    copy_into,
)
from services.scheduler.layers.rotary import rotary_permutation, rotate_qkv
from services.scheduler.models.base import LayerEnv
from services.scheduler.models.config import ModelConfig

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, head_dim]


def make_norm(cfg: ModelConfig, size: int, env: LayerEnv, fused: bool = False) -> RMSNorm:
    """A norm of ``cfg.norm_style`` over ``size``; ``fused``: with the backend's kernels (hidden-state norms)."""
    return NORMS[cfg.norm_style](size, cfg.rms_norm_eps, env.dtype, env.fused if fused else None)


def activation(cfg: ModelConfig, env: LayerEnv) -> Activation:
    """The gated activation of ``cfg.hidden_act``: the backend's C kernel for SiLU where it offers one."""
    if cfg.hidden_act == "silu" and env.fused is not None:
        return env.fused.silu_and_mul
    return ACTIVATIONS[cfg.hidden_act]


class Attention(torch.nn.Module):
    """qkv projection (column-parallel, this rank's heads), optional per-head q/k RMSNorm, rotary,
    the paged attention backend with the layer's window, o projection (row-parallel, summed).

    Rotary is applied here (``layers.rotary.rotate_qkv``), unless the backend declares that it
    rotates and stores K/V in one kernel (``AttentionBackend.fuses_rotary``: the cpu backend's
    C path, faster than the torch rotation and store); then it gets the un-rotated projection.

    Attributes:
        window: the layer's sliding window (0: global).
        softcap: attention logit soft-capping, 0 (no released config of a served family uses
            it; the backends implement it, and tests switch it on).
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, env: LayerEnv):
        super().__init__()
        spec = cfg.layers[layer_id]
        self.layer_id = layer_id
        self.attn_backend = env.attention
        self.fuses_rotary = env.attention.fuses_rotary
        self.tp = env.tp
        self.head_dim = d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          cfg.attention_bias, env.tp, env.dtype,
                                          rotary_permutation(d, spec.rope.scaling))
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, env.tp, env.dtype)
        self.scale = cfg.attention_scale
        self.window = spec.sliding_window
        self.softcap = 0.0
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm, self.k_norm = make_norm(cfg, d, env), make_norm(cfg, d, env)
            perm = self.qkv_proj.qk_perm
            if perm is not None:  # the norms' dims follow the heads' reordered dims
                for norm in (self.q_norm, self.k_norm):
                    norm.weight.weight_loader = lambda p, w, shard_id=None: copy_into(p.data, w.index_select(0, perm))

    def forward(self, h: torch.Tensor, rope: Rope, meta: AttnMetadata, kv: KVBuffers) -> torch.Tensor:
        """h: [T, hidden] -> [T, hidden] (summed over the ranks)."""
        return self.tp.all_reduce(self.o_proj(self.attend(self.qkv_proj(h), rope, meta, kv)))

    def attend(self, qkv: torch.Tensor, rope: Rope, meta: AttnMetadata, kv: KVBuffers) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) * D] (this rank's heads) -> attention output [T, Hq * D]."""
        if self.q_norm is not None:
            t = qkv.shape[0]
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).view(t, self.q_size)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size)
            qkv = torch.cat([q, k, v], dim=-1)
        if self.fuses_rotary:  # the backend's one kernel: rotary and the K/V store
            return self.attn_backend.forward_rotary(qkv, *rope, self.num_heads, self.layer_id, meta, kv, self.scale,
                                                    self.window, self.softcap)
        q, k, v = rotate_qkv(qkv, *rope, self.num_heads, self.num_kv_heads, self.head_dim)
        return self.attn_backend.forward(q, k, v, self.layer_id, meta, kv, self.scale, self.window, self.softcap)


class GatedMLP(torch.nn.Module):
    """``down(act(gate(h)) * up(h))``, gate and up fused: this rank's columns, down_proj row-parallel.

    Args:
        reduce: sum the output over the ranks (False: the caller sums, as a MoE block does
            with its shared expert).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act: Activation, env: LayerEnv, reduce: bool = True):
        super().__init__()
        self.tp = env.tp
        self.reduce = reduce
        self.act = act
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, env.tp, env.dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, env.tp, env.dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [T, hidden] -> [T, hidden]."""
        out = self.down_proj(self.act(self.gate_up_proj(h)))
        return self.tp.all_reduce(out) if self.reduce else out


class SparseMoeBlock(torch.nn.Module):
    """Router, top-k experts (``layers.moe``) and an optional sigmoid-gated shared expert (Qwen2-MoE).

    A layer's MLP is a router (``gate``: hidden -> E logits, on every rank), the top-k experts of
    each token (softmax, top k, renormalized as the config says) and the experts as grouped
    matmuls over stacked weights: the CPU path sorts the tokens by expert
    (``layers.moe.fused_experts_cpu``), a device kernel (``LayerEnv.fused_experts``: the Triton
    grouped GEMM on CUDA) runs them in one launch. Experts and shared expert hold this rank's
    slice of their intermediate dim; one all-reduce sums both.
    """

    def __init__(self, cfg: ModelConfig, env: LayerEnv):
        super().__init__()
        self.tp = env.tp
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.act = activation(cfg, env)
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, False, env.dtype)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, env.tp, env.dtype)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, self.act, env,
                                          reduce=False)
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, False, env.dtype)
        self.fused_experts = env.fused_experts

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [T, hidden] -> [T, hidden] (summed over the ranks)."""
        weights, ids = select_experts(self.gate(h), self.top_k, self.renormalize)  # float32 [T, K], int64 [T, K]
        if self.fused_experts is None:
            out = fused_experts_cpu(h, weights, ids, self.experts.num_experts, self.experts.mlp(self.act))
        else:
            out = self.fused_experts(h, self.experts.gate_up, self.experts.down, weights, ids, self.act)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return self.tp.all_reduce(out)


class PreNormLayer(torch.nn.Module):
    """``h += attn(norm(h)); h += mlp(norm(h))`` (Llama, Qwen, Mistral, Phi-3, the MoE models),
    each residual add inside the next norm (``RMSNorm.add``)."""

    def __init__(self, cfg: ModelConfig, attn: Attention, mlp: torch.nn.Module, env: LayerEnv):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, env, fused=True)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, env, fused=True)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, meta: AttnMetadata,
                kv: KVBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) [T, hidden] each (see the module docstring) -> the MLP's output and the residual."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x = self.input_layernorm.add(x, residual)
        x = self.post_attention_layernorm.add(self.self_attn(x, rope, meta, kv), residual)
        return self.mlp(x), residual


class SandwichLayer(torch.nn.Module):
    """Gemma's four norms: ``h += post_norm(attn(norm(h))); h += post_ff_norm(mlp(pre_ff_norm(h)))``:
    the residual adds the *normalized* attention and MLP outputs."""

    def __init__(self, cfg: ModelConfig, attn: Attention, mlp: torch.nn.Module, env: LayerEnv):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, make_norm(cfg, cfg.hidden_size, env))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, meta: AttnMetadata,
                kv: KVBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``PreNormLayer.forward``."""
        h = x if residual is None else residual + x
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope, meta, kv))
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))), h
