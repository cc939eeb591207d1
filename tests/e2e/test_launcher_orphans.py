"""The launcher's life cycle: killed with SIGKILL (no chance to stop its children) every
service still exits, through the parent-death signal each one sets for itself after exec;
Ctrl-C stops the ring even when the launcher inherited SIGINT ignored (started in the
background by a shell); its KV memory share is split over the replicas; its ports are distinct;
each process is wired to its peers and gets the options passed on to its service.

The first two end the session's shared rings (``keyed_ring``, ``stack``), so they run after
every other test (``pytest.mark.ends_ring``) and launch no ring of their own."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ringserve.launch import Launcher, free_port, free_ports, parse_args, service_processes
from tests.helpers.ringstack import SERVICES


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.ends_ring
def test_every_service_exits_when_the_launcher_is_killed(keyed_ring) -> None:
    ring = keyed_ring  # launched for other tests; this one, run after them all, ends it
    pids = {name: ring.pid(name) for name in SERVICES}
    assert all(_running(pid) for pid in pids.values())
    os.kill(ring.proc.pid, signal.SIGKILL)
    ring.proc.wait()
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline and any(_running(pid) for pid in pids.values()):
        time.sleep(0.2)
    assert {name: _running(pid) for name, pid in pids.items()} == dict.fromkeys(SERVICES, False)


@pytest.mark.ends_ring
def test_ctrl_c_stops_a_launcher_started_with_sigint_ignored(stack) -> None:
    """The session ring starts as a shell's background job does (``trap "" INT``, see
    ``ringstack.launched``); this test, run after all the others, ends it."""
    proc = stack.proc
    children = [pid for name in SERVICES for pid, _ in service_processes(proc.pid, name)]
    assert len(children) == 4
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    assert [pid for pid in children if _running(pid)] == []


def test_kv_memory_share_is_split_over_replicas() -> None:
    def fraction(*flags: str) -> list[str]:
        args = Launcher(parse_args(["--model", "m", *flags]))._scheduler_args("1", "127.0.0.1:2", 0)
        return [args[i + 1] for i, a in enumerate(args) if a in ("--kv-cache-mem-fraction", "--kv-cache-gib",
                                                                 "--max-total-tokens")]

    assert fraction() == ["0.3"]
    assert fraction("--replicas", "2") == ["0.15"]
    assert fraction("--replicas", "4", "--kv-cache-mem-fraction", "0.6") == ["0.15"]
    assert fraction("--replicas", "2", "--kv-cache-gib", "1.5") == ["1.5"]
    assert fraction("--max-total-tokens", "4096") == ["4096"]


def test_quantization_reaches_every_scheduler() -> None:
    def quant(*flags: str) -> list[str]:
        launcher = Launcher(parse_args(["--model", "m", "--replicas", "2", *flags]))
        return [" ".join(args[i : i + 2]) for args in (launcher._scheduler_args("1", "127.0.0.1:2", r) for r in (0, 1))
                for i, a in enumerate(args) if a == "--quantization"]

    assert quant() == []
    assert quant("--quantization", "int8wo") == ["--quantization int8wo"] * 2
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--quantization", "fp8"])


def test_free_ports_are_distinct_and_avoid_the_fixed_ones() -> None:
    """The launcher picks every spare port at once (holding each socket until all are
    picked), so two services can never be handed the same port."""
    taken = free_port()
    for _ in range(20):
        ports = free_ports(16, exclude={taken})
        assert len(ports) == len(set(ports)) == 16 and taken not in ports


def test_each_process_is_wired_to_its_peers_and_gets_what_is_passed_on() -> None:
    launcher = Launcher(parse_args(["--model", "m", "--replicas", "2", "--tokenizers", "2", "--served-model-name", "x",
                                    "--reasoning-parser", "qwen3", "--allow-special-tokens-in-messages"]))
    launcher.plan()
    addr = launcher.addresses
    args = {name: launcher.args(name) for name in addr} | {"gateway": launcher.args("gateway")}
    replicas = [f"{addr[f'scheduler-{i}']},{addr[f'detokenizer-{i}']}" for i in (0, 1)]
    for i in (0, 1):
        tok = args[f"tokenizer-{i}"]
        assert [tok[j + 1] for j, a in enumerate(tok) if a == "--replica"] == replicas
        assert tok[tok.index("--port") + 1] == addr[f"tokenizer-{i}"].rsplit(":", 1)[1]
        assert tok[-3:] == ["--served-model-name", "x", "--allow-special-tokens-in-messages"]
        assert args[f"detokenizer-{i}"][-2:] == ["--served-model-name", "x"]
        sched = args[f"scheduler-{i}"]
        assert sched[sched.index("--detokenizer") + 1] == addr[f"detokenizer-{i}"]
        assert sched[sched.index("--instance-id") + 1] == f"scheduler-{i}"
    assert args["gateway"][args["gateway"].index("--tokenizer") + 1] == \
        f"ipv4:{addr['tokenizer-0']},{addr['tokenizer-1']}"
    assert args["gateway"][-2:] == ["--reasoning-parser", "qwen3"]
    assert len({a.rsplit(':', 1)[1] for a in addr.values()} | set(map(str, launcher.metrics_ports.values()))) == 12
