"""``ringserve launch``'s entry point: check, prepare, start, print where everything is, watch, stop."""

from __future__ import annotations

import dataclasses
import signal
import sys

from ringserve.internal_auth import SKIP_FLAG
from ringserve.launch.flags import parse_args
from ringserve.launch.launcher import Launcher
from ringserve.models.gguf import DEFAULT_CACHE, resolve_model
from ringserve.models.packaged import SMOLLM2_DIR, prepare_smollm2
from ringserve.ports import PortInUse, check_ports


def main(argv: list[str] | None = None) -> None:
    """``ringserve launch``: parse the flags, check the ports, prepare the model, run the ring until a signal."""
    config = parse_args(argv)
    try:
        check_ports(config.host, vars(config))
    except PortInUse as exc:
        sys.exit(f"ringserve launch: {exc}")
    try:
        # A GGUF is converted here, once, before any service starts; they get the directory.
        config = dataclasses.replace(config, model=resolve_model(config.model))
    except RuntimeError as exc:
        sys.exit(f"ringserve launch: {exc}")
    if not (config.model / "config.json").exists():
        if config.model != DEFAULT_CACHE / "models" / SMOLLM2_DIR:
            sys.exit(f"ringserve launch: {config.model} has no config.json")
        prepare_smollm2()
    launcher = Launcher(config)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    # SIGINT too: a launcher started in the background by a shell inherits SIGINT ignored,
    # and Python then never turns Ctrl-C into KeyboardInterrupt.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    status = 0
    try:
        launcher.start()
        host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
        print(f"ringserve: serving {config.model.name} at http://{host}:{config.port}/v1", flush=True)
        for name, addr in launcher.addresses.items():
            print(f"ringserve: {name} gRPC at {addr}", flush=True)
        for line in launcher.topology():
            print(f"ringserve: {line}", flush=True)
        print("ringserve: internal links " + ("authenticated by the ring's credential" if config.internal_auth else
                                               f"NOT authenticated ({SKIP_FLAG})"), flush=True)
        for name, url in launcher.metrics_urls.items():
            print(f"ringserve: {name} metrics at {url}", flush=True)
        status = launcher.watch()
    except KeyboardInterrupt:
        status = 0
    except RuntimeError as exc:
        print(f"ringserve: {exc}", file=sys.stderr)
        status = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        launcher.stop()
    sys.exit(status)
