"""The resident adapters: names, slots, the requests using each, and each step's rows per adapter.

The scheduler is the one place the adapter list lives: ``--lora-modules`` loads at start,
the LoadLoraAdapter / UnloadLoraAdapter RPCs change it at run time, and every load report
tells the tokenizers the resident names (which the gateway lists in ``/v1/models``).

Policy (vLLM's endpoints, simpler residency):

- at most ``--max-loras`` adapters are resident (slots); loading one more is refused with a
  message naming the limit -- nothing is evicted behind the user's back;
- unloading an adapter takes its name away at once (new requests for it are refused as an
  unknown model) and frees its weights when the last request using it ends: a running
  request is never broken, and its slot stays taken until then;
- each load gets a prefix-cache namespace of its own (``namespace``), so KV computed under
  one adapter (or the base) is never reused under another, nor under a later load of the
  same name.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from services.scheduler.lora.adapter import AdapterError, read_adapter
from services.scheduler.lora.layers import LoraModel
from services.scheduler.lora.namespace import NAMESPACES


class LoraLimitError(ValueError):
    """A load refused by the resident limit or a name already in use."""


@dataclass(frozen=True)
class LoraOp:
    """A change of the resident set that rank 0 sends to the other tensor-parallel ranks
    (``executor.tp``), between steps: "load" the adapter at ``path`` into ``slot``, or "drop" it."""

    kind: str
    slot: int
    path: str = ""

    def apply(self, model: LoraModel, max_rank: int) -> None:
        """Do it on this rank's ``model`` (its own shard of the adapter)."""
        if self.kind == "load":
            model.add(self.slot, read_adapter(Path(self.path), model.shapes, model.num_layers, max_rank))
        else:
            model.drop(self.slot)


@dataclass(eq=False)
class Adapter:
    """A resident adapter.

    Attributes:
        slot: its index in the model's ``LoraLinear``s (0..max_loras-1).
        namespace: its prefix-cache namespace (1..4095, see ``namespaced``).
        refs: requests holding it (queued, waiting or running).
        unloaded: its name is gone; the slot frees when ``refs`` reaches 0.
    """

    name: str
    path: str
    rank: int
    slot: int
    namespace: int
    refs: int = 0
    unloaded: bool = False


class LoraRegistry:
    """Rank 0's resident set over a model's ``LoraModel``.

    Args:
        model: the wrapped model's ``LoraModel``.
        max_loras: ``--max-loras``; max_rank: ``--max-lora-rank``.

    Attributes:
        mirror: called with each ``LoraOp`` once rank 0 has done it (tensor parallelism: sends
            it to the other ranks); None on one rank.
    """

    def __init__(self, model: LoraModel, max_loras: int, max_rank: int):
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.by_name: dict[str, Adapter] = {}
        self.by_slot: dict[int, Adapter] = {}
        self._namespaces = itertools.cycle(range(1, NAMESPACES + 1))
        self.mirror: Callable[[LoraOp], None] | None = None

    def load(self, name: str, path: str) -> Adapter:
        """Read, check and place the adapter at ``path`` under ``name``.

        Raises:
            AdapterError: the adapter cannot be served (``adapter.read_adapter``).
            LoraLimitError: ``name`` is resident already, or ``max_loras`` slots are taken.
        """
        if name in self.by_name:
            raise LoraLimitError(f"adapter {name!r} is already loaded (from {self.by_name[name].path}); unload it "
                                 "first")
        free = [s for s in range(self.max_loras) if s not in self.by_slot]
        if not free:
            raise LoraLimitError(f"{self.max_loras} adapters are resident (--max-loras); unload one first")
        weights = read_adapter(Path(path), self.model.shapes, self.model.num_layers, self.max_rank)
        adapter = Adapter(name, str(path), weights.rank, free[0], next(self._namespaces))
        self.model.add(adapter.slot, weights)
        self.by_name[name] = self.by_slot[adapter.slot] = adapter
        if self.mirror is not None:
            self.mirror(LoraOp("load", adapter.slot, adapter.path))
        return adapter

    def unload(self, name: str) -> bool:
        """Take ``name`` away; returns True when its weights are freed now, False when they
        are freed as its last request ends.

        Raises:
            KeyError: no adapter of that name is loaded.
        """
        adapter = self.by_name.pop(name)
        adapter.unloaded = True
        if adapter.refs == 0:
            self._free(adapter)
            return True
        return False

    def acquire(self, name: str) -> Adapter | None:
        """The adapter a new request names, held until ``release``; None for no such name."""
        adapter = self.by_name.get(name)
        if adapter is not None:
            adapter.refs += 1
        return adapter

    def release(self, adapter: Adapter) -> None:
        """A request that held ``adapter`` ended; an unloaded adapter's last frees its slot."""
        adapter.refs -= 1
        if adapter.refs == 0 and adapter.unloaded:
            self._free(adapter)

    def _free(self, adapter: Adapter) -> None:
        del self.by_slot[adapter.slot]
        self.model.drop(adapter.slot)
        if self.mirror is not None:
            self.mirror(LoraOp("drop", adapter.slot))

    def names(self) -> list[str]:
        """The names requests may use, in load order."""
        return list(self.by_name)


def step_rows(slots: list[int | None], token_counts: list[int]) -> tuple[torch.Tensor, list[tuple[int, int]]] | None:
    """The packed token rows of each adapter in a step.

    Args:
        slots: each request's adapter slot (None: the base model), in the step's order.
        token_counts: each request's tokens in the step (its extend length; 1 for a decode).

    Returns:
        (int64 [n + 3 g] host tensor: the n rows grouped by slot in the order of ``groups``,
        then the segment table of the segmented kernel, each group's slot, start in the rows
        and length (``layers.LoraBatch.set`` views both); groups: (slot, its row count)), or
        None when no row has an adapter.
    """
    rows: dict[int, list[int]] = {}
    start = 0
    for slot, n in zip(slots, token_counts, strict=True):
        if slot is not None:
            rows.setdefault(slot, []).extend(range(start, start + n))
        start += n
    if not rows:
        return None
    sizes = [len(r) for r in rows.values()]
    starts = list(itertools.accumulate(sizes, initial=0))[:-1]
    return (torch.tensor([r for slot in rows for r in rows[slot]] + list(rows) + starts + sizes, dtype=torch.int64),
            list(zip(rows, sizes, strict=True)))




def open_registry(model: LoraModel | None, cfg) -> LoraRegistry | None:
    """The engine's registry over ``model`` (None: LoRA off) with ``cfg.lora_modules`` loaded.

    Args:
        cfg: an ``EngineConfig`` (lora_modules "NAME=PATH" each, max_loras, max_lora_rank).

    Raises:
        ValueError: an entry not of the form NAME=PATH, or an adapter that cannot be loaded
            (``AdapterError``, ``LoraLimitError``: more than ``--max-loras``, a name twice).
    """
    if model is None:
        return None
    registry = LoraRegistry(model, cfg.max_loras, cfg.max_lora_rank)
    for entry in cfg.lora_modules:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {entry!r}: expected NAME=PATH")
        registry.load(name, path)
    return registry


__all__ = ["AdapterError", "Adapter", "LoraLimitError", "LoraOp", "LoraRegistry", "open_registry", "step_rows"]
