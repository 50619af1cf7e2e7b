"""A stand-in sandbox whose node fails half-way through starting: what that node had already started
is stopped with the rest, so the command that failed leaves no thread serving behind."""

from __future__ import annotations

import contextlib
import io
import threading
from pathlib import Path

import pytest
from gpushare.deviceplugin import wiring
from support.waiting import wait_until

from gpushare.sandbox.cluster import Sandbox
from gpushare.sandbox.nodespec import NodeSpec
from gpushare.sandbox.printout import Progress


def test_a_node_that_fails_to_start_is_stopped_with_the_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuses(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device plugin refused to start")

    monkeypatch.setattr(wiring, "start_device_plugin", refuses)
    before = set(threading.enumerate())
    sandbox = Sandbox([NodeSpec("node-a", "1xA10:24576")], "binpack", False, tmp_path)
    with pytest.raises(RuntimeError, match="device plugin refused"):
        sandbox.start(Progress(3, io.StringIO()))
    sandbox.stop()

    def left() -> list[str]:
        return [t.name for t in set(threading.enumerate()) - before if t.is_alive()]

    # the node's advertiser, kubelet emulator and pod watch were running when the device plugin failed;
    # the API stand-in's request threads end as their watches are closed
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not left(), 5, "the sandbox's threads to end")
    assert left() == []
