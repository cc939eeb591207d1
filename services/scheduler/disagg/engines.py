"""The KV transfer engines by name (``--disaggregation-transfer-backend``): ``grpc``
(``transfer.py``) and ``mooncake`` (``mooncake.py``), both behind ``transfer.KvTransfer``.
Apart from ``transfer.py`` because ``mooncake.py`` builds on it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.scheduler.disagg.transfer import GrpcKvTransfer, KvTransfer

ENGINES = ("grpc", "mooncake")  # --disaggregation-transfer-backend


def make_transfer(name: str, to_device: Callable[[torch.Tensor], torch.Tensor] | None = None) -> KvTransfer:
    """The engine named ``name``, its host-to-device copy ``to_device``. Raises ValueError
    naming the engines there are."""
    if name == "grpc":
        return GrpcKvTransfer(to_device)
    if name == "mooncake":
        # Imported only when chosen: it loads Mooncake's native libraries.
        from services.scheduler.disagg.mooncake import MooncakeKvTransfer
        return MooncakeKvTransfer(to_device)
    raise ValueError(f"unknown KV transfer engine {name!r}; available: {list(ENGINES)}")
