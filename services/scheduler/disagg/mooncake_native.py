"""Loading Mooncake's transfer engine and the system libraries its shared library links.

``mooncake/engine.so`` (``mooncake-transfer-engine-non-cuda``) links ``libibverbs.so.1``,
``libnl-3.so.200`` and ``libnl-route-3.so.200`` even for its TCP transport, which machines
without RDMA often lack. ``make setup`` unpacks the Debian packages that hold them
(``libibverbs1``, ``libnl-3-200``, ``libnl-route-3-200``) into ``NATIVE_DIR`` inside the
virtualenv; the scheduler's image installs them with apt. ``load_engine`` loads those present
in ``NATIVE_DIR`` with ``RTLD_GLOBAL`` before importing ``mooncake``, so the dynamic linker finds
them already loaded: neither ``LD_LIBRARY_PATH`` nor root is needed. No torch here: a process
that only needs the engine starts quickly.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Any

NATIVE_DIR = Path(sys.prefix) / "lib" / "ringserve-native"
# In load order: libibverbs needs libnl-route-3, which needs libnl-3.
NATIVE_LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")


def load_engine() -> Any:
    """Mooncake's ``TransferEngine`` class, after loading its native libraries from ``NATIVE_DIR``
    (those present there; the system's otherwise).

    Raises:
        RuntimeError: mooncake is not installed or its libraries are missing, naming the fix.
    """
    for name in NATIVE_LIBS:
        if (NATIVE_DIR / name).exists():
            ctypes.CDLL(str(NATIVE_DIR / name), mode=ctypes.RTLD_GLOBAL)
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise RuntimeError(
            f"the mooncake KV transfer engine cannot be loaded ({exc}): it needs the scheduler extra's "
            f"mooncake-transfer-engine-non-cuda and the libibverbs1, libnl-3-200 and libnl-route-3-200 libraries "
            f"(`make setup` unpacks them into {NATIVE_DIR}); or use --disaggregation-transfer-backend grpc") from exc
    return TransferEngine
