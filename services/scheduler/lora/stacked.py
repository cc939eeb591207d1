"""The resident adapters' weights of one linear stacked by slot, for the segmented kernel (CUDA).

``kernels.triton_lora.sgmv`` reads an adapter's weights by its slot id from one tensor per
side, so the CUDA path keeps, per wrapped linear:

- ``a``: [slots, parts * R, in (this rank's)]: part p's A (q, k, v or gate, up) in rows
  ``p R .. p R + r``;
- ``b``: [slots, out (this rank's), parts * R]: part p's B in columns ``p R .. p R + r``
  (placed at its part's rows of the fused output), so the fused B is block-diagonal;
- ``scales``: float32 [slots]: the adapter's scale, 0 where the slot holds nothing for this
  linear (the kernel skips those segments).

R is the largest rank placed so far (rounded up to 16); everything past an adapter's own rank is zero, so
different ranks share the stack (padded to the largest, as S-LoRA pads within a batch).
Loading fills a slot, unloading zeroes it (with ops that run on fake CUDA tensors for the
placement checks: ``Tensor.copy_`` and ``t[i] = ...`` set a device guard first, which a
CUDA-less torch cannot, so a slot is zeroed and its weights added); the stack grows (a copy, between steps) when a
slot index or a rank beyond it arrives. The CPU path keeps each adapter's own (A, B) and
the grouped torch product instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def segmented_kernel() -> Callable[..., torch.Tensor]:
    """``kernels.triton_lora.sgmv``, imported where it runs: triton is the ``cuda`` extra's, and
    a CPU install has none."""
    from services.scheduler.kernels.triton_lora import sgmv

    return sgmv


class SlotStack:
    """One linear's stacked adapter weights (module docstring).

    Args:
        parts: the linear's fused parts (1, 2 or 3); in_local, out_local: this rank's features.
    """

    def __init__(self, parts: int, in_local: int, out_local: int, dtype: torch.dtype, device: torch.device):
        self.parts, self.in_local, self.out_local = parts, in_local, out_local
        self.a = torch.zeros(0, 0, in_local, dtype=dtype, device=device)
        self.b = torch.zeros(0, out_local, 0, dtype=dtype, device=device)
        self.scales = torch.zeros(0, dtype=torch.float32, device=device)

    @property
    def rank(self) -> int:
        """R: the padded rank of every slot."""
        return self.a.shape[1] // self.parts

    def _grow(self, slots: int, rank: int) -> None:
        """Room for ``slots`` slots of rank ``rank``, the placed weights kept at their places."""
        old_slots, old_rank, p = self.a.shape[0], self.rank, self.parts
        if slots <= old_slots and rank <= old_rank:
            return
        # R in multiples of 16: tl.dot's smallest tile, and the same alignment (the strides'
        # divisibility the JIT specializes on) for every adapter rank, so one compiled kernel serves.
        slots, rank = max(slots, old_slots), max(-(-rank // 16) * 16, old_rank)
        i, o, more = self.in_local, self.out_local, slots - old_slots
        pad = torch.nn.functional.pad  # zeros after each part's old rank and after the old slots
        self.a = pad(self.a.view(old_slots, p, old_rank, i), (0, 0, 0, rank - old_rank, 0, 0, 0, more)).view(
            slots, p * rank, i)
        self.b = pad(self.b.view(old_slots, o, p, old_rank), (0, rank - old_rank, 0, 0, 0, 0, 0, more)).view(
            slots, o, p * rank)
        self.scales = torch.cat([self.scales, self.scales.new_zeros(slots - old_slots)])

    def place(self, slot: int, parts: list[tuple[int, torch.Tensor, torch.Tensor]], scale: float) -> None:
        """Fill ``slot`` with (part index, A [r, in_local], B [out_local, r]) per adapted part;
        no parts: an adapter that leaves this linear alone (the slot is made and stays zero,
        so the kernel can read its scale)."""
        self._grow(slot + 1, max((a.shape[0] for _, a, _ in parts), default=0))
        self.clear(slot)
        if not parts:
            return
        rank = self.rank
        for p, a, b in parts:  # into the zeroed slot: add_ is the copy (see the module docstring)
            r = a.shape[0]
            self.a.select(0, slot).narrow(0, p * rank, r).add_(a)
            self.b.select(0, slot).narrow(1, p * rank, r).add_(b)
        self.scales.select(0, slot).fill_(scale)

    def clear(self, slot: int) -> None:
        """Zero ``slot`` (its segments are skipped from now on)."""
        if slot < self.a.shape[0]:
            self.a.select(0, slot).zero_()
            self.b.select(0, slot).zero_()
            self.scales.select(0, slot).zero_()

    def apply(self, x: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, segments: torch.Tensor,
              max_len: int) -> torch.Tensor:
        """``out`` plus each segment's product (``kernels.triton_lora.sgmv``), in place."""
        return segmented_kernel()(x.contiguous(), out, self.a, self.b, self.scales, rows, segments, max_len)
