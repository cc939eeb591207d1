"""The scheduler's LoRA RPCs over its registry: LoadLoraAdapter, UnloadLoraAdapter, ListLoraAdapters.

Each runs in the engine thread between steps (``EngineLoop.call``), so a load or an unload
never lands inside a forward; reading an adapter holds the loop for as long as its files
take to read (milliseconds for the ranks LoRA uses).
"""

from __future__ import annotations

from collections.abc import Callable

from ringserve.limits import LimitExceeded, check_lora_fields
from ringserve.v1 import lora_pb2
from services.scheduler.lora.adapter import AdapterError
from services.scheduler.lora.registry import LoraLimitError, LoraRegistry

OFF = "LoRA adapters are off on this scheduler (--max-loras 0, or --quantization)"


class LoraRefused(Exception):
    """A LoRA RPC refused: ``status`` is the gRPC status code's name, ``message`` says why."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def adapter_list(registry: LoraRegistry | None) -> lora_pb2.LoraAdapterList:
    """The names requests may use now (ListLoraAdapters' answer)."""
    if registry is None:
        return lora_pb2.LoraAdapterList()
    return lora_pb2.LoraAdapterList(
        adapters=[lora_pb2.LoraAdapter(name=a.name, path=a.path, rank=a.rank) for a in registry.by_name.values()],
        max_loras=registry.max_loras)


def load_adapter(registry: LoraRegistry | None, request: lora_pb2.LoadLoraAdapterRequest,
                 reserved: Callable[[str], bool]) -> lora_pb2.LoraAdapterList:
    """Load ``request.lora_path`` as ``request.lora_name``; returns the new list.

    Args:
        reserved: whether a name is the base model's (served name or path), which an adapter may not take.

    Raises:
        LoraRefused: INVALID_ARGUMENT (no name or path, a reserved name, an adapter that
            cannot be served), FAILED_PRECONDITION (LoRA off, the name in use, --max-loras reached).
    """
    _check_lengths(request.lora_name, request.lora_path)
    if registry is None:
        raise LoraRefused("FAILED_PRECONDITION", OFF)
    name, path = request.lora_name, request.lora_path
    if not name or not path:
        raise LoraRefused("INVALID_ARGUMENT", "lora_name and lora_path are required")
    if reserved(name):
        raise LoraRefused("INVALID_ARGUMENT", f"lora_name {name!r} is the base model's name")
    try:
        registry.load(name, path)
    except AdapterError as exc:
        raise LoraRefused("INVALID_ARGUMENT", str(exc)) from None
    except LoraLimitError as exc:
        raise LoraRefused("FAILED_PRECONDITION", str(exc)) from None
    return adapter_list(registry)


def unload_adapter(registry: LoraRegistry | None,
                   request: lora_pb2.UnloadLoraAdapterRequest) -> lora_pb2.LoraAdapterList:
    """Unload ``request.lora_name`` (requests running on it finish on it); returns the new list.

    Raises:
        LoraRefused: FAILED_PRECONDITION (LoRA off), NOT_FOUND (no adapter of that name),
            INVALID_ARGUMENT (a name over ``ringserve.limits.MAX_LORA_NAME_CHARS``).
    """
    if registry is None:
        raise LoraRefused("FAILED_PRECONDITION", OFF)
    _check_lengths(request.lora_name)
    if request.lora_name not in registry.by_name:
        raise LoraRefused("NOT_FOUND", f"no LoRA adapter named {request.lora_name!r} is loaded")
    registry.unload(request.lora_name)
    return adapter_list(registry)


def _check_lengths(name: str, path: str = "") -> None:
    """INVALID_ARGUMENT for a name or path over ``ringserve.limits``' bounds (the refusals quote them)."""
    try:
        check_lora_fields(name, path)
    except LimitExceeded as exc:
        raise LoraRefused("INVALID_ARGUMENT", exc.message) from None
