"""A step's decoder layers in one C call (``kernels/cpu/decoder.c``) where every layer is a
pre-norm layer with the C library's linears (``DecoderForCausalLM.fuse_cpu_linears``: int8,
or bf16 on AMX).

Why: the Python loop over the layers (``DecoderForCausalLM._fused_layers``) makes six C calls
a layer, and the Python between them (output allocations, metadata, ctypes) was ~5 ms of a
15 ms batch-1 int8 step on one core. ``rs_decoder_layers`` makes the same calls with the same
arguments, in the same order, from C: the same bits, and the Python is paid once a step.

The table of the layers (weights' addresses, norms, KV pool rows, rope, window, scale) is
built on the first step and again when the KV pool or a role's kernel choice changes; the
model forgets it when its tensors move (``DecoderForCausalLM._apply``). A step whose
attention the C kernels cannot run alone (an extend part attended by SDPA, outside
deterministic inference; a KV pool of another dtype than the activations) runs the Python
loop.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch

from services.scheduler.attention.paged import AttnMetadata, KVBuffers
from services.scheduler.kernels.cpu_kernels import library

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
ROLES = ("qkv", "o", "gate_up", "down")  # decoder.c's order of a layer's linears


class _Weights(ctypes.Structure):
    _fields_ = [("wp", _P), ("ws", _P), ("comp", _P), ("bias", _P), ("N", _I64), ("K", _I64), ("Kp", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [*((role, _Weights) for role in ROLES), ("input_norm", _P), ("post_norm", _P), ("k_buf", _P),
                ("v_buf", _P), ("rope", _I64), ("window", _I64), ("input_eps", _F), ("post_eps", _F), ("scale", _F),
                ("softcap", _F)]


class _AttnPart(ctypes.Structure):
    _fields_ = [("n", _I64), ("kv_indices", _P), ("idx_stride", _I64), ("rows", _P), ("seq_lens", _P)]


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = library()
    lib.rs_decoder_layers.argtypes = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64,
                                      ctypes.c_int]
    lib.rs_decoder_layers.restype = ctypes.c_int
    return lib


def _weights(linear) -> _Weights:
    """A ``CpuLinear``'s buffers as decoder.c reads them."""
    return _Weights(*linear.weight_ptrs(), linear.out_features, linear.in_features, linear.k_padded)


def layer_linears(layer) -> tuple:
    """A ``PreNormLayer``'s four linears in ``ROLES`` order."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


class LayerStack:
    """The decoder layers of ``model`` (a ``DecoderForCausalLM`` whose ``fuse_cpu_linears`` held)
    in one call: ``forward(h, ropes, meta, kv)`` -> the last layer's output, h updated in place
    as the residual stream (``DecoderForCausalLM._fused_layers``' contract), or None."""

    def __init__(self, model: torch.nn.Module):
        self._model = weakref.ref(model)  # the model holds this object: no reference cycle
        self.forget()

    @property
    def model(self) -> torch.nn.Module:
        model = self._model()
        assert model is not None, "the model of this LayerStack was freed"
        return model

    def forget(self) -> None:
        """Drop the table: call it after moving the weights or norms, or changing a layer's
        window, soft-cap or kernels (the model's ``_apply`` calls it)."""
        self._table: ctypes.Array | None = None
        self._key: tuple | None = None
        self._kv: KVBuffers | None = None  # the pool the table points into, held so it cannot be reused

    def _build(self, kv: KVBuffers, key: tuple) -> ctypes.Array | None:
        """The layers' table, or None where some layer's linear of a role chose other kernels
        than layer 0's (``choose_kernels`` gives a shape one choice; this guards a hand-set one)."""
        layers = self.model.layers
        self._key, self._kv = key, kv
        first = layer_linears(layers[0])
        if any(lin.kernels != ref.kernels
               for layer in layers for lin, ref in zip(layer_linears(layer), first, strict=True)):
            self._table = None
            return None
        table = (_Layer * len(layers))()
        for entry, layer, rope in zip(table, layers, self.model.layer_rope, strict=True):
            attn, pre, post = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
            for role, linear in zip(ROLES, layer_linears(layer), strict=True):
                setattr(entry, role, _weights(linear))
            entry.input_norm, entry.input_eps = pre.weight.data_ptr(), pre.eps
            entry.post_norm, entry.post_eps = post.weight.data_ptr(), post.eps
            entry.k_buf, entry.v_buf = kv.k_buffer[attn.layer_id].data_ptr(), kv.v_buffer[attn.layer_id].data_ptr()
            entry.rope, entry.window, entry.scale, entry.softcap = rope, attn.window, attn.scale, attn.softcap
        self._table = table
        return table

    def forward(self, h: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]], meta: AttnMetadata,
                kv: KVBuffers) -> torch.Tensor | None:
        """h: [T, hidden], the embedding's output (the residual stream from here on) -> the last
        layer's output [T, hidden]; or None, nothing done, where the step's attention does not
        run on the C kernels alone. They run it where every part is decode queries (a decode
        part; an extend part under deterministic inference, whose tokens are decode queries)
        and the KV pool holds the activations' dtype."""
        ext, dec = meta.extend, meta.decode
        if ext is not None and ext.token_seq_lens is None:
            return None  # an extend part attended by SDPA (deterministic inference off)
        t, hidden = h.shape
        n = meta.num_extend_tokens
        # Each part's (tokens, kv_indices, rows or None, seq_lens), the extend one first: read
        # through raw pointers, so int64 and contiguous (held here while the call reads them).
        parts = []
        if ext is not None:
            parts.append((n, ext.kv_indices.contiguous(), ext.token_rows.contiguous(), ext.token_seq_lens.contiguous()))
        if dec is not None:
            parts.append((t - n, dec.kv_indices.contiguous(), None, dec.seq_lens.contiguous()))
        loc = meta.out_cache_loc.contiguous()
        index = [loc, *(x for part in parts for x in part[1:] if x is not None)]
        if (any(x.dtype != torch.int64 for x in index) or h.dtype not in (torch.bfloat16, torch.float32)
                or not h.is_contiguous() or kv.k_buffer[0].dtype != h.dtype or kv.v_buffer[0].dtype != h.dtype
                or not all(c.is_contiguous() and s.is_contiguous() for c, s in ropes)):
            return None
        first = self.model.layers[0]
        linears = layer_linears(first)
        key = (kv.k_buffer[0].data_ptr(), kv.v_buffer[0].data_ptr(), *(lin.kernels for lin in linears))
        table = self._table if kv is self._kv and key == self._key else self._build(kv, key)
        if table is None:
            return None
        out = torch.empty_like(h)
        if t == 0:
            return out
        kernels = (ctypes.c_int * 4)(*(lin.kernel_id(lin.kernel_for(t), h.dtype) for lin in linears))
        c_parts = (_AttnPart * len(parts))(*(
            _AttnPart(tokens, idx.data_ptr(), idx.shape[1], None if rows is None else rows.data_ptr(), lens.data_ptr())
            for tokens, idx, rows, lens in parts))
        cos = (_P * len(ropes))(*(c.data_ptr() for c, _ in ropes))
        sin = (_P * len(ropes))(*(s.data_ptr() for _, s in ropes))
        attn = first.self_attn
        rc = _lib().rs_decoder_layers(table, len(table), kernels, h.data_ptr(), out.data_ptr(), t, hidden,
                                      attn.num_heads, attn.num_kv_heads, attn.head_dim, cos, sin, loc.data_ptr(),
                                      c_parts, len(parts), int(h.dtype == torch.bfloat16))
        if rc != 0:
            raise MemoryError(f"rs_decoder_layers: no scratch for a step of {t} tokens")
        return out
