"""Every way out of ``gpushare sandbox`` on the real cluster stops everything it started: a signal
during start-up or while it is kept running, and a component that fails to start. Each test runs a real
sandbox, and afterwards no process, mount, mount namespace, bridge, veth or temporary file of it is left."""

from __future__ import annotations

import shutil
import signal
import stat
from pathlib import Path

import pytest
from support.sandboxrun import SandboxRun, bridges_and_ports, leftovers

from gpushare.sandbox import binaries
from gpushare.sandbox.podnetwork import bridge_name, node_link
from gpushare.sandbox.realcluster import realcluster_available

pytestmark = pytest.mark.skipif(
    realcluster_available() is not None, reason=f"no real cluster here: {realcluster_available()}"
)
STOP_SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT]
#: the default nodes
NODES = 2


def bridges_of(workdir: Path) -> list[str]:
    """The nodes' pod bridges and the link holding their addresses."""
    return [*(bridge_name(workdir, index) for index in range(NODES)), node_link(workdir)]


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_stop_signal_during_start_up_stops_everything(directory: Path, signum: int) -> None:
    run = SandboxRun(directory)
    try:
        # etcd, kube-apiserver and kube-controller-manager run; the nodes are being started
        run.err.wait_for("[2/4]", 120)
        workdir = run.workdir
        run.signal(signum)
        code = run.wait()
    finally:
        run.kill()
    assert code == 128 + signum, run.err.text
    if signum != signal.SIGINT:
        assert f"stopped by {signal.Signals(signum).name}" in run.err.text
    assert leftovers(directory, set(bridges_of(workdir))) == []


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_stop_signal_while_kept_running_stops_everything(directory: Path, signum: int) -> None:
    run = SandboxRun(directory, "--keep-running")
    try:
        run.printed("Ctrl-C", 240)
        workdir = run.workdir
        network = bridges_and_ports(bridges_of(workdir))
        run.signal(signum)
        code = run.wait()
    finally:
        run.kill()
    # Ctrl-C is the way it asks to be stopped; the others are reported
    assert code == (0 if signum == signal.SIGINT else 128 + signum), run.err.text
    # the example pods ran on the nodes' bridges, with a veth each
    assert set(bridges_of(workdir)) <= network and len(network) > NODES, network
    assert leftovers(directory, network) == []


def test_a_component_that_fails_to_start_stops_the_rest_and_only_its_logs_are_kept(
    directory: Path, tmp_path: Path
) -> None:
    """kube-apiserver exits at once, after etcd has started; etcd is stopped and the logs say why."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for binary in binaries.bin_dir().iterdir():
        (bin_dir / binary.name).symlink_to(binary)
    broken = bin_dir / "kube-apiserver"
    broken.unlink()
    broken.write_text("#!/bin/sh\necho 'kube-apiserver: cannot start here' >&2\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    run = SandboxRun(directory, env={"GPUSHARE_KUBE_BIN": str(bin_dir)})
    try:
        code = run.wait()
    finally:
        run.kill()
    assert code == 1, run.err.text
    assert "kube-apiserver exited with 3" in run.err.text
    workdir = run.workdir
    assert f"the components' logs are kept in {workdir}" in run.err.text
    kept = {str(p.relative_to(workdir)) for p in workdir.rglob("*") if not p.is_dir()}
    assert {"etcd.log", "kube-apiserver.log", "sandbox.log"} <= kept and all(k.endswith(".log") for k in kept)
    assert "cannot start here" in (workdir / "kube-apiserver.log").read_text()
    shutil.rmtree(workdir)
    assert leftovers(directory) == []
