"""The detached CRI shim (gpushare.crishim.detached, .handover) in front of a real containerd: it outlives a
node agent killed as an OOM kill or runc would kill its container, the next agent adopts it rather than
start a second one, and an agent with new settings takes its socket over while a client calling in a loop,
as kubelet does, sees no call fail."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import podfactory
import pytest
from gpushare.crishim import handover
from gpushare.crishim.detached import ProcessId, Record, ShimHome, cgroup_paths, escape_dirs, made_cgroup
from gpushare.crishim.frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    ERROR_CANCEL,
    ERROR_REFUSED_STREAM,
    FRAME_HEADER,
    GOAWAY,
    HEADERS,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    frame,
    frame_at,
    grpc_message,
)
from gpushare.crishim.handover import fingerprint
from gpushare.crishim.wiring import start_cri_shim
from hpack import Encoder
from support.waiting import wait_until

from gpushare.contract.names import ENV_POD_UID
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import SimulatedBackend
from gpushare.memlimits.cgroups import cgroup_mounts
from gpushare.node import components
from gpushare.pb import cri_pb2 as pb
from gpushare.pb import cri_pb2_grpc as pb_grpc
from gpushare.sandbox.containerd import TEST_IMAGE, Containerd, containerd_available, running_containerd
from gpushare.sandbox.cri_kubelet import CriRuntime
from gpushare.settings import NodeSettings, RewriteOptions, ShimSettings

CGROUP_ROOT = Path("/sys/fs/cgroup")
AGENT = Path(__file__).parents[1] / "support" / "shimagent.py"


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the shim moves itself between cgroups"
    if not escape_dirs(CGROUP_ROOT):
        return f"no cgroup hierarchy mounted under {CGROUP_ROOT}"
    return containerd_available()


needs_real = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


@pytest.fixture(scope="module")
def containerd() -> Iterator[Containerd]:
    with running_containerd(Path(tempfile.mkdtemp(prefix="gs-ctrd-"))) as daemon:
        yield daemon


def _cgroup_pids(directory: Path) -> set[int]:
    with contextlib.suppress(FileNotFoundError):
        return {int(pid) for pid in (directory / "cgroup.procs").read_text().split()}
    return set()


def _join(cgroups: list[Path]) -> None:
    """Move the calling process into ``cgroups`` (in a child, before exec)."""
    for directory in cgroups:
        (directory / "cgroup.procs").write_text(str(os.getpid()))


@dataclass
class Node:
    """A machine of its own in cgroup terms (a cgroup in every hierarchy, below this test's, held by an
    anchor process); in it the agent's "container" (a cgroup below it) and the cgroup the detached shims
    escape to, beside it. Everything in it is ended when the test is."""

    socket: Path
    runtime: str
    machine: list[Path]
    anchor: subprocess.Popen[bytes]
    #: where the shims go: :func:`escape_dirs` below the anchor's cgroups
    escaped: list[Path]
    agents: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def home(self) -> ShimHome:
        return ShimHome(self.socket)

    @property
    def container(self) -> list[Path]:
        return [directory / "agent" for directory in self.machine]

    def start_agent(self, block_unrequested_gpu: bool = True) -> dict[str, int]:
        """An agent in the container's cgroups; what it printed (adopted, and its shim's supervisor)."""
        container = self.container
        argv = [sys.executable, str(AGENT), str(self.socket), self.runtime, str(self.anchor.pid)]
        agent = subprocess.Popen(
            [*argv, "1" if block_unrequested_gpu else "0"],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=lambda: _join(container),
        )
        self.agents.append(agent)
        assert agent.stdout is not None
        line = agent.stdout.readline()  # the agent prints once its shim serves, or exits
        assert line, f"the agent exited with {agent.wait()}; see {self.home.log_path}"
        return json.loads(line)

    def kill_container(self, agent: subprocess.Popen[str]) -> None:
        """SIGKILL the agent's process group, then every process left in its cgroups, as runc does to a
        container in the host's PID namespace (signalAllProcesses)."""
        os.killpg(agent.pid, signal.SIGKILL)
        _kill_all(self.container)
        agent.wait()
        wait_until(lambda: not any(_cgroup_pids(d) for d in self.container), 10, "the container's cgroups empty")

    def supervisor(self) -> ProcessId:
        record = self.home.live()
        assert record is not None, f"no detached shim serves {self.socket}"
        return record.supervisor

    def shim_processes(self) -> set[int]:
        """Every process of this node's detached shims (supervisors and workers)."""
        return _cgroup_pids(self.escaped[0])

    def close(self) -> None:
        for agent in self.agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        record = self.home.read()
        if record is not None:
            record.supervisor.signal(signal.SIGTERM)
            wait_until(lambda: not record.supervisor.alive(), 30, "the detached shim to stop")
        _kill_all(self.escaped)  # what a failed test may have left
        wait_until(lambda: not any(_cgroup_pids(d) for d in self.escaped), 10, "the shims' cgroups empty")
        self.anchor.kill()
        self.anchor.wait()
        for directory in [*self.container, *self.escaped, *self.machine]:
            with contextlib.suppress(OSError):
                directory.rmdir()


def _kill_all(cgroups: list[Path]) -> None:
    for directory in cgroups:
        for pid in _cgroup_pids(directory):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def node(containerd: Containerd) -> Iterator[Node]:
    base = Path(tempfile.mkdtemp(prefix="gs-det-", dir="/tmp"))
    own = cgroup_paths(Path("/proc/self/cgroup").read_text())
    name = f"gs-node-{uuid.uuid4().hex[:8]}"
    machine = []
    for fstype, mount in cgroup_mounts(Path("/proc/self/mountinfo").read_text()):
        if CGROUP_ROOT in mount.parents or mount == CGROUP_ROOT:
            below = own.get("" if fstype == "cgroup2" else mount.name, "/").lstrip("/")
            machine.append(made_cgroup(mount / below / name))
    for directory in machine:
        made_cgroup(directory / "agent")
    anchor = subprocess.Popen(["cat"], stdin=subprocess.PIPE, preexec_fn=lambda: _join(machine))
    found = Node(base / "cri.sock", containerd.address, machine, anchor, escape_dirs(CGROUP_ROOT, anchor.pid))
    try:
        yield found
    finally:
        found.close()
        containerd.remove_all_pods()
        shutil.rmtree(base, ignore_errors=True)


def run_pod(socket: Path, name: str) -> dict[str, str]:
    """A pod with one container, run through the shim; the env its process got."""
    runtime = CriRuntime(f"unix://{socket}")
    try:
        pod = podfactory.gpu_pod(name, [podfactory.container("main", 0, image=TEST_IMAGE)])
        return runtime.run_pod(pod, {}, TEST_IMAGE)["main"]
    finally:
        runtime.close()


@needs_real
def test_the_shim_outlives_its_agent_killed_with_its_container_and_the_next_agent_adopts_it(node: Node) -> None:
    first = node.start_agent()
    assert not first["adopted"]
    supervisor = node.supervisor()
    assert supervisor.pid == first["pid"]
    assert not any(supervisor.pid in _cgroup_pids(d) for d in node.container)
    node.kill_container(node.agents[0])

    assert supervisor.alive()
    assert run_pod(node.socket, "after-kill")["NVIDIA_VISIBLE_DEVICES"] == "void"  # the shim still checks

    second = node.start_agent()
    assert second["adopted"]
    assert node.supervisor() == supervisor
    assert len(node.shim_processes()) == 2  # one supervisor, one worker: no second shim
    assert run_pod(node.socket, "after-adoption")["NVIDIA_VISIBLE_DEVICES"] == "void"


@needs_real
def test_an_agent_stopped_as_a_pod_is_deleted_leaves_the_shim_serving(node: Node) -> None:
    node.start_agent()
    agent = node.agents[0]
    agent.terminate()
    assert agent.wait(30) == 0
    assert node.supervisor().alive()
    assert run_pod(node.socket, "after-sigterm")["NVIDIA_VISIBLE_DEVICES"] == "void"


@needs_real
def test_a_killed_worker_is_restarted_by_its_supervisor(node: Node) -> None:
    node.start_agent()
    supervisor = node.supervisor()
    (worker,) = node.shim_processes() - {supervisor.pid}
    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: len(node.shim_processes() - {supervisor.pid, worker}) == 1, 30, "a new worker")
    assert node.supervisor() == supervisor
    wait_until(lambda: _version_ok(node.socket), 30, "the new worker to serve")


def _version_ok(socket: Path) -> bool:
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        try:
            pb_grpc.RuntimeServiceStub(channel).Version(pb.VersionRequest(), timeout=5)
        except grpc.RpcError:
            return False
    return True


@dataclass
class CallingLoop:
    """Calls the runtime through the shim over one channel, back to back, as kubelet does."""

    socket: Path
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with grpc.insecure_channel(f"unix://{self.socket}") as channel:
            stub = pb_grpc.RuntimeServiceStub(channel)
            while not self.stopping.is_set():
                try:
                    stub.Version(pb.VersionRequest(), timeout=10)
                    stub.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=10)
                except grpc.RpcError as exc:
                    self.failed.append(f"{exc.code().name}: {exc.details()}")
                else:
                    self.ok += 1


@needs_real
def test_an_agent_with_new_settings_takes_the_socket_over_without_a_failed_call(node: Node) -> None:
    node.start_agent(block_unrequested_gpu=True)
    old = node.supervisor()
    loop = CallingLoop(node.socket)
    caller = threading.Thread(target=loop.run, daemon=True)
    caller.start()
    try:
        wait_until(lambda: loop.ok >= 20 or bool(loop.failed), 30, "calls through the old shim")
        upgraded = node.start_agent(block_unrequested_gpu=False)
        assert not upgraded["adopted"]
        new = node.supervisor()
        assert new != old
        wait_until(lambda: not old.alive(), 30, "the old shim to drain and exit")
        after = loop.ok
        wait_until(lambda: loop.ok >= after + 20 or bool(loop.failed), 30, "calls through the new shim")
    finally:
        loop.stopping.set()
        caller.join(30)
    assert loop.failed == []
    assert len(node.shim_processes()) == 2
    assert "NVIDIA_VISIBLE_DEVICES" not in run_pod(node.socket, "after-upgrade")  # the new settings apply


NODE_SETTINGS = NodeSettings("node-a", None, "sim:1xA100-80GB:81920", Path("/nonexistent"), GIB, frozenset())
SHIM_SETTINGS = ShimSettings("unix:///run/gpushare/cri.sock", "unix:///run/containerd/containerd.sock", True,
                             RewriteOptions())  # fmt: skip


def test_a_new_image_new_flags_or_a_new_pod_make_a_new_shim_and_nothing_else_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_POD_UID, "pod-1")
    same = fingerprint(NODE_SETTINGS, SHIM_SETTINGS)
    assert fingerprint(NODE_SETTINGS, SHIM_SETTINGS) == same
    flags = ShimSettings(SHIM_SETTINGS.listen, SHIM_SETTINGS.runtime, False, SHIM_SETTINGS.options)
    assert fingerprint(NODE_SETTINGS, flags) != same
    monkeypatch.setattr(handover, "code_digest", lambda: "another image")
    assert fingerprint(NODE_SETTINGS, SHIM_SETTINGS) != same
    monkeypatch.undo()
    monkeypatch.setenv(ENV_POD_UID, "pod-2")
    assert fingerprint(NODE_SETTINGS, SHIM_SETTINGS) != same


def test_a_record_naming_an_ended_process_is_no_live_shim(tmp_path: Path) -> None:
    home = ShimHome(tmp_path / "cri.sock")
    assert home.live() is None
    ended = subprocess.Popen(["true"])
    ended.wait()
    me = ProcessId.of(os.getpid())
    assert me is not None and ProcessId.of(ended.pid) is None
    home.write(Record(ProcessId(ended.pid, me.start_time), "f"))
    assert home.live() is None
    home.write(Record(me, "f"))
    assert home.live() == Record(me, "f")
    assert not ProcessId(me.pid, me.start_time + 1).alive()  # the same pid, another process


def test_the_node_agent_with_detach_cri_shim_starts_the_detached_shim(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[object, ...]] = []
    monkeypatch.setattr(handover, "start_detached_shim", lambda *args: started.append(args) or "shim")
    shared = type("Shared", (), {"start": None, "api": None})()
    backend = SimulatedBackend("node-a", "1xA100-80GB:81920")
    found = components(NODE_SETTINGS, SHIM_SETTINGS, backend, shared, 60.0, detach=Path("/host/sys/fs/cgroup"))  # type: ignore[arg-type]
    (spec,) = [spec for spec in found if spec.name == "cri-shim"]
    assert spec.start() == "shim"
    assert started == [(NODE_SETTINGS, SHIM_SETTINGS, Path("/host/sys/fs/cgroup"))]


class Frames:
    """The frames arriving on a raw socket, in order."""

    def __init__(self, sock: socket.socket, skip: int = 0) -> None:
        self._sock, self._buf, self._pos = sock, b"", skip

    def next(self) -> tuple[int, int, int, bytes] | None:
        """The next frame (type, flags, stream, payload); None once the peer has closed."""
        while (found := frame_at(self._buf, self._pos)) is None:
            chunk = self._sock.recv(65536)
            if not chunk:
                return None
            self._buf += chunk
        end, kind, flags, stream = found
        payload, self._pos = self._buf[self._pos + FRAME_HEADER : end], end
        return kind, flags, stream, payload

    def until(self, kind: int, stream: int) -> tuple[int, bytes]:
        """Skip to the next frame of ``kind`` on ``stream``: its flags and payload."""
        while (found := self.next()) is not None:
            if found[0] == kind and found[2] == stream:
                return found[1], found[3]
        raise AssertionError(f"the connection closed before a frame of type {kind} on stream {stream}")


def test_a_draining_shim_finishes_the_calls_under_way_refuses_new_ones_as_unprocessed_then_closes(
    tmp_path: Path,
) -> None:
    """What a shim handing its socket over does to each kubelet connection, frame by frame: GOAWAY naming
    the last call it takes, REFUSED_STREAM (which gRPC retries elsewhere) for a call opened after it,
    whose header block the runtime still sees (its HPACK table) but whose request it never gets."""
    path = tmp_path / "runtime.sock"
    version = "/runtime.v1.RuntimeService/Version"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen(1)
        listener.settimeout(5)
        shim = ShimSettings(f"unix://{tmp_path}/shim.sock", f"unix://{path}", False, RewriteOptions())
        running = start_cri_shim(NODE_SETTINGS, shim, SimulatedBackend("node-a", "1xA100-80GB:81920"), None)
        encoder, answers = Encoder(), Encoder()

        def call(stream: int) -> bytes:
            block = encoder.encode([(":method", "POST"), (":path", version)])
            message = grpc_message(pb.VersionRequest().SerializeToString())
            return frame(HEADERS, END_HEADERS, stream, block) + frame(DATA, END_STREAM, stream, message)

        kubelet = socket.socket(socket.AF_UNIX)
        kubelet.settimeout(5)
        kubelet.connect(str(running.shim.path))
        kubelet.sendall(PREFACE + frame(SETTINGS, 0, 0) + call(1))
        runtime, _ = listener.accept()
        draining = threading.Thread(target=running.drain, args=(10.0,))
        with kubelet, runtime:
            runtime.settimeout(5)
            at_runtime, at_kubelet = Frames(runtime, skip=len(PREFACE)), Frames(kubelet)
            at_runtime.until(DATA, 1)
            draining.start()
            _, payload = at_kubelet.until(GOAWAY, 0)
            assert int.from_bytes(payload[:4], "big") == 1
            kubelet.sendall(call(3))
            _, payload = at_kubelet.until(RST_STREAM, 3)
            assert int.from_bytes(payload, "big") == ERROR_REFUSED_STREAM
            at_runtime.until(HEADERS, 3)
            assert at_runtime.next() == (RST_STREAM, 0, 3, ERROR_CANCEL.to_bytes(4, "big"))  # not its DATA
            trailers = answers.encode([(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "0")])
            runtime.sendall(frame(HEADERS, END_HEADERS | END_STREAM, 1, trailers))
            flags, _ = at_kubelet.until(HEADERS, 1)
            assert flags & END_STREAM
            assert at_kubelet.next() is None  # the shim closed the connection, its last call done
            draining.join(10)
            assert not draining.is_alive()
        assert not running.shim.path.exists()
