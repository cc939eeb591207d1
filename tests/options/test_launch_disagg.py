"""``ringserve launch --prefill-replicas N --decode-replicas M``: N + M replicas, the first N
schedulers in prefill mode and the others in decode mode, each with its share of the KV memory."""

from __future__ import annotations

import pytest

from ringserve.launch.flags import parse_args
from ringserve.launch.launcher import Launcher


def _flags(launcher: Launcher, index: int, *names: str) -> list[str]:
    args = launcher._scheduler_args("1", "127.0.0.1:2", index)
    return [f"{a} {args[i + 1]}" for i, a in enumerate(args) if a in names]


def test_prefill_and_decode_replicas_give_each_scheduler_its_mode():
    launcher = Launcher(parse_args(["--model", "m", "--prefill-replicas", "1", "--decode-replicas", "2"]))
    assert launcher.config.replicas == 3
    assert [_flags(launcher, i, "--disaggregation-mode", "--kv-cache-mem-fraction") for i in range(3)] == [
        ["--disaggregation-mode prefill", "--kv-cache-mem-fraction 0.1"],
        ["--disaggregation-mode decode", "--kv-cache-mem-fraction 0.1"],
        ["--disaggregation-mode decode", "--kv-cache-mem-fraction 0.1"]]
    launcher.plan()
    assert [line.split(":")[0] for line in launcher.topology()[1:]] == [
        "replica 0 (prefill)", "replica 1 (decode)", "replica 2 (decode)"]
    plain = Launcher(parse_args(["--model", "m", "--replicas", "2"]))
    assert _flags(plain, 1, "--disaggregation-mode") == []


@pytest.mark.parametrize("flags", [["--prefill-replicas", "1"], ["--decode-replicas", "2"],
                                   ["--prefill-replicas", "1", "--decode-replicas", "1", "--replicas", "2"]])
def test_one_side_alone_or_with_replicas_is_refused(flags):
    with pytest.raises(SystemExit, match="--prefill-replicas and --decode-replicas go together"):
        parse_args(["--model", "m", *flags])
