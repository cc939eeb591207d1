"""Attention backends behind an explicit registry: ``torch`` (the reference), ``cpu`` (C kernels) and ``triton`` (GPU).

Every backend does the same thing for one step described by ``AttnMetadata``: write the
step's new K/V into the layer's paged pool at ``out_cache_loc``, then attend the extend
part (prefill, with or without a cached prefix) and the decode part (one query per
request), packed extend first. The model holds one backend, chosen when it is built
(``--attention-backend``), calls ``init_forward_metadata`` once per step and ``forward``
once per layer (the SGLang ``AttentionBackend`` split).

Mixed steps (chunked prefill beside running decodes) run each part with its own kernel in
both backends: the Triton decode kernel for the decode rows and the Triton extend kernel
for the extend rows, writing into disjoint slices of one output, so decode rows are never
padded to a chunk's length and neither kernel pays for the other's shape.

Rotary is the model's (``models.blocks.Attention``): it rotates q and k and calls ``forward``.
A backend may offer more, declared in this contract and chosen when the model is built:
``fuses_rotary`` (the cpu backend: rotary and the K/V store in one C kernel,
``forward_rotary``, which runs faster than torch's rotation and store) and ``fused_ops``
(its element-wise kernels for the model's norms and activation).

No silent fallback: an unknown name raises with the known ones, and a backend the device
cannot run raises with the device runtime's reason (``DeviceRuntime.attention_backend_refusal``:
``cpu`` off the CPU, ``triton`` on the CPU unless Triton's interpreter was on when the kernels
were defined).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from ringserve.options import names
from services.scheduler.attention.paged import (
    AttnMetadata,
    KVBuffers,
    extend_attention,
    gather_kv,
    gather_layouts,
    paged_attention,
    store_kv,
)
from services.scheduler.layers.norm import FusedOps

if TYPE_CHECKING:
    from services.scheduler.executor.device import DeviceRuntime

log = logging.getLogger(__name__)


class AttentionBackend(ABC):
    """One attention implementation over the paged KV cache.

    ``batch_invariant`` backends can run deterministic inference: given the per-token
    extend fields (``ExtendLayout.token_seq_lens``) they attend every token with their
    decode kernel, whose result for a query depends on nothing else in the step.

    Args:
        device: where the model's weights and KV pool live.
    """

    name: ClassVar[str]
    # Element-wise kernels the model's blocks may run instead of torch ops (RMSNorm with the
    # residual add, SiLU-and-mul), chosen when the model is built; None: torch ops.
    fused_ops: FusedOps | None = None
    # Takes the un-rotated fused projection (``forward_rotary``): rotary and the K/V store in one
    # kernel, instead of the model's rotation in torch before ``forward``.
    fuses_rotary: ClassVar[bool] = False
    # Kernel launches depend only on the batch size (no host ints that vary per step):
    # the decode forward can be captured once per bucket (``executor.cuda_graph``).
    supports_cuda_graph: ClassVar[bool] = False
    batch_invariant: ClassVar[bool] = False

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def describe(self) -> str:
        """What runs, for the start-up log."""
        return f"{self.name} on {self.device}"

    def init_forward_metadata(self, meta: AttnMetadata) -> None:  # noqa: B027 - an optional hook
        """Prepare what every layer of this step shares (called once per forward, before the layers)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, meta: AttnMetadata,
                kv: KVBuffers, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """Write k/v into layer ``layer_id``'s pool at ``meta.out_cache_loc``, then attend.

        Args:
            q: [T, Hq, D]; k, v: [T, Hkv, D] in the model dtype, packed extend tokens first,
                then one token per decoding request.
            scale: softmax scale, usually D ** -0.5.
            window: the calling layer's sliding window in tokens, 0 for none: the query at
                position p attends keys at positions p - window < j <= p (``attention.paged``).
            softcap: the layer's attention logit soft-capping ``cap * tanh(s / cap)``, 0 for none.

        Returns:
            [T, Hq * D] in q's dtype.
        """


    def forward_rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                       layer_id: int, meta: AttnMetadata, kv: KVBuffers, scale: float, window: int = 0,
                       softcap: float = 0.0) -> torch.Tensor:
        """Rotary on the fused projection's q and k, the K/V store and attention in one call, for
        a backend that ``fuses_rotary`` (the model rotates in torch and calls ``forward`` otherwise).

        Args:
            qkv: [T, (Hq + 2 Hkv) * D]: q heads, k heads, v heads (q and k not yet rotated).
            cos, sin: [T, 1, D] in qkv's dtype, the rotary tables at each token's position.
            num_heads: Hq (Hkv and D come from the KV pool).
            window, softcap: as in ``forward``.

        Returns:
            [T, Hq * D] in qkv's dtype.

        Raises:
            NotImplementedError: the backend does not fuse rotary.
        """
        raise NotImplementedError(f"attention backend {self.name!r} does not fuse rotary with its K/V store")


class TorchAttnBackend(AttentionBackend):
    """Gathered K/V, batched matmuls (decode) and SDPA (extend) in the cache dtype, softmax in fp32:
    ``attention.paged.paged_attention``."""

    name = "torch"

    def init_forward_metadata(self, meta: AttnMetadata) -> None:
        if meta.extend is not None and meta.extend.token_seq_lens is not None:
            raise ValueError("the torch attention backend is not batch-invariant (SDPA and batched matmuls reduce "
                             "in a batch-dependent order): deterministic inference needs --attention-backend cpu "
                             "or triton")
        gather_layouts(meta)

    def forward(self, q, k, v, layer_id, meta, kv, scale, window=0, softcap=0.0):
        return paged_attention(q, k, v, layer_id, meta, kv, scale, window, softcap)


class TritonAttnBackend(AttentionBackend):
    """The Triton kernels of ``kernels.triton_attention``, reading K/V in place through the req-to-token rows
    (on CUDA, or on the CPU under Triton's interpreter: ``create_attention_backend`` checks)."""

    name = "triton"
    supports_cuda_graph = True
    batch_invariant = True

    def __init__(self, device: torch.device):
        super().__init__(device)
        # Imported here, not at module load: the torch backend must not need triton, and
        # the interpreter choice is made when triton defines the kernels.
        from services.scheduler.kernels import triton_attention

        self.kernels = triton_attention

    def init_forward_metadata(self, meta: AttnMetadata) -> None:
        """Nothing to derive: the kernels read K/V rows through the req-to-token table and
        the layouts' slots in place, with grid sizes from the layouts' host ints."""

    def forward(self, q, k, v, layer_id, meta, kv, scale, window=0, softcap=0.0):
        k_buf, v_buf = store_kv(k, v, layer_id, meta.out_cache_loc, kv)
        t, hq, d = q.shape
        n = meta.num_extend_tokens
        out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
        ext, dec = meta.extend, meta.decode
        if ext is not None and ext.token_seq_lens is not None:  # deterministic: each token as a decode query
            self.kernels.decode_attention(q.narrow(0, 0, n), k_buf, v_buf, meta.req_to_token, ext.token_seq_lens, scale,
                                          out=out.narrow(0, 0, n), req_slots=ext.token_slots, window=window,
                                          softcap=softcap)
        elif ext is not None:
            self.kernels.extend_attention(
                q.narrow(0, 0, n), k_buf, v_buf, meta.req_to_token, ext.prefix_lens, ext.extend_lens, scale,
                max_extend_len=ext.max_extend_len, out=out.narrow(0, 0, n), req_slots=ext.req_slots, window=window,
                softcap=softcap)
        if dec is not None:
            self.kernels.decode_attention(q.narrow(0, n, t - n), k_buf, v_buf, meta.req_to_token, dec.seq_lens, scale,
                                          out=out.narrow(0, n, t - n), req_slots=dec.req_slots, window=window,
                                          softcap=softcap)
        return out.view(t, hq * d)


class CpuAttnBackend(AttentionBackend):
    """The C kernels of ``kernels.cpu_kernels``: decode attention reading K/V in place, rotary
    fused with the K/V store (``fuses_rotary``); extend attention as the torch backend (SDPA
    over gathered rows).

    It also offers the model its fused element-wise kernels (``fused_ops``: residual add +
    RMSNorm, SiLU-and-mul), which cut a batch-1 step's per-op overhead.

    Raises:
        cpu_kernels.KernelBuildError: no C compiler, or the kernels did not build.
    """

    name = "cpu"
    batch_invariant = True
    fuses_rotary = True

    def __init__(self, device: torch.device):
        super().__init__(device)
        from services.scheduler.kernels import cpu_kernels

        # Build (or find) and load it now: errors at start-up, not at the first step.
        self.library = cpu_kernels.library()
        self.kernels = cpu_kernels
        self.fused_ops = cpu_kernels.CpuOps()

    def describe(self) -> str:
        return f"cpu: C kernels {self.library._name}"

    def init_forward_metadata(self, meta: AttnMetadata) -> None:
        gather_layouts(meta)

    def forward(self, q, k, v, layer_id, meta, kv, scale, window=0, softcap=0.0):
        k_buf, v_buf = store_kv(k, v, layer_id, meta.out_cache_loc, kv)
        return self._attend(q.contiguous(), k_buf, v_buf, meta, scale, window, softcap)

    def forward_rotary(self, qkv, cos, sin, num_heads, layer_id, meta, kv, scale, window=0, softcap=0.0):
        k_buf, v_buf = kv.k_buffer[layer_id], kv.v_buffer[layer_id]
        q = self.kernels.rotary_store(qkv, cos, sin, meta.out_cache_loc, k_buf, v_buf, num_heads)
        return self._attend(q, k_buf, v_buf, meta, scale, window, softcap)

    def _attend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: AttnMetadata,
                scale: float, window: int, softcap: float) -> torch.Tensor:
        t, hq, d = q.shape
        n = meta.num_extend_tokens
        q = q.to(k_buf.dtype)
        out = torch.empty(t, hq, d, dtype=k_buf.dtype)
        ext = meta.extend
        if ext is not None and ext.token_seq_lens is not None:  # deterministic: each token as a decode query
            self.kernels.decode_attention(q.narrow(0, 0, n), k_buf, v_buf, ext.kv_indices, ext.token_seq_lens, scale,
                                          out=out.narrow(0, 0, n), window=window, softcap=softcap, rows=ext.token_rows)
        elif ext is not None:
            keys, values = gather_kv(k_buf, v_buf, meta.extend.kv_indices)
            out[:n] = extend_attention(q.narrow(0, 0, n), keys.transpose(1, 2), values.transpose(1, 2), meta.extend,
                                       scale, window, softcap).view(n, hq, d)
        if meta.decode is not None:
            self.kernels.decode_attention(q.narrow(0, n, t - n), k_buf, v_buf, meta.decode.kv_indices,
                                          meta.decode.seq_lens, scale, out=out.narrow(0, n, t - n), window=window,
                                          softcap=softcap)
        return out.view(t, hq * d)


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchAttnBackend.name: TorchAttnBackend,
    TritonAttnBackend.name: TritonAttnBackend,
    CpuAttnBackend.name: CpuAttnBackend,
}
names.check_registry("attention backend", ATTENTION_BACKENDS, names.ATTENTION_BACKENDS)


def create_attention_backend(name: str, runtime: DeviceRuntime) -> AttentionBackend:
    """The backend called ``name`` for the runtime's device; "auto" is the runtime's default
    (``DeviceRuntime.default_attention_backend``: triton on CUDA, cpu on the CPU -- torch
    there, with a warning that says why, when the C kernels cannot be built).

    Raises:
        ValueError: ``name`` is neither "auto" nor in ``ATTENTION_BACKENDS`` (the message lists them).
        RuntimeError: a backend the device cannot run (``DeviceRuntime.attention_backend_refusal``).
    """
    if name == "auto":
        name = runtime.default_attention_backend
        if name == "cpu":
            try:
                return _logged(CpuAttnBackend(runtime.device))
            except RuntimeError as exc:
                log.warning("attention backend 'cpu' unavailable, using 'torch': %s", exc)
                name = "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: auto, {', '.join(sorted(ATTENTION_BACKENDS))}")
    refusal = runtime.attention_backend_refusal(name)
    if refusal is not None:
        raise RuntimeError(refusal)
    return _logged(ATTENTION_BACKENDS[name](runtime.device))


def _logged(backend: AttentionBackend) -> AttentionBackend:
    log.info("attention backend %s", backend.describe())
    return backend
