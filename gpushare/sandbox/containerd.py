"""A private containerd for tests, benchmarks and the sandbox: its own root, state and socket under one
directory, configured so that CRI pods run on this kind of machine (no image pulls; the host network unless the
caller puts a CNI config in its cni-conf directory, as the real cluster does).

Images can't be pulled here, so :func:`build_busybox_image` packs the host's static busybox into a
docker-archive tarball that doubles as the pause image, and :meth:`Containerd.import_image` loads it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import platform
import shutil
import signal
import struct
import subprocess
import tarfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from gpushare.pb import cri_pb2, cri_pb2_grpc
from gpushare.sandbox import binaries
from gpushare.sandbox.launch import log_tail

log = logging.getLogger(__name__)

PAUSE_IMAGE = "registry.k8s.io/pause:3.9"
TEST_IMAGE = "gpushare.test/busybox:1"
BUSYBOX = Path("/bin/busybox")
K8S_NAMESPACE = "k8s.io"
#: the image's default command; it must keep running because the same image serves as the pause image
IDLE_COMMAND = ("/bin/sleep", "2147483647")

_PT_INTERP = 3
GO_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le", "s390x": "s390x"}


class ContainerdError(RuntimeError):
    """containerd could not be started, reached or given an image."""


def containerd_available() -> str | None:
    """None when a private containerd can run here, else why not (a reason to skip)."""
    if os.geteuid() != 0:
        return "containerd needs root"
    if reason := binaries.missing(binaries.CONTAINERD_BINARIES) or binaries.host_tool_missing(("runc",)):
        return reason
    if not BUSYBOX.is_file():
        return f"{BUSYBOX} is missing (apt-get install -y busybox-static)"
    if not is_static_elf(BUSYBOX):
        return f"{BUSYBOX} is dynamically linked; the image needs busybox-static"
    return None


def is_static_elf(path: Path) -> bool:
    """True for a 64-bit little-endian ELF file without a program interpreter."""
    with path.open("rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return False
        (phoff,) = struct.unpack_from("<Q", head, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    return all(struct.unpack_from("<I", table, i * phentsize)[0] != _PT_INTERP for i in range(phnum))


# --- the image --------------------------------------------------------------------------------------------


def _tar_member(
    tar: tarfile.TarFile, name: str, *, kind: bytes, data: bytes = b"", mode: int = 0o755, link: str = ""
) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.mtime = 0
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def _busybox_layer() -> bytes:
    applets = subprocess.run([str(BUSYBOX), "--list"], check=True, capture_output=True, text=True).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for directory in ("bin", "dev", "etc", "proc", "sys", "tmp", "root"):
            _tar_member(tar, directory, kind=tarfile.DIRTYPE, mode=0o1777 if directory == "tmp" else 0o755)
        _tar_member(tar, "bin/busybox", kind=tarfile.REGTYPE, data=BUSYBOX.read_bytes())
        for applet in sorted(set(applets) - {"busybox"}):
            _tar_member(tar, f"bin/{applet}", kind=tarfile.SYMTYPE, link="busybox", mode=0o777)
        _tar_member(tar, "etc/passwd", kind=tarfile.REGTYPE, data=b"root:x:0:0:root:/root:/bin/sh\n", mode=0o644)
        _tar_member(tar, "etc/group", kind=tarfile.REGTYPE, data=b"root:x:0:\n", mode=0o644)
    return buf.getvalue()


def build_busybox_image(path: Path, tags: Sequence[str] = (PAUSE_IMAGE, TEST_IMAGE)) -> Path:
    """Write a docker-archive tarball of a busybox rootfs, tagged with every name in ``tags``."""
    layer = _busybox_layer()
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps(
        {
            "architecture": GO_ARCH.get(platform.machine(), platform.machine()),
            "os": "linux",
            "config": {"Env": ["PATH=/bin"], "Cmd": list(IDLE_COMMAND), "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created_by": "gpushare busybox image"}],
        },
        sort_keys=True,
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    layer_name = diff_id.removeprefix("sha256:") + "/layer.tar"
    manifest = json.dumps([{"Config": config_name, "RepoTags": list(tags), "Layers": [layer_name]}]).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        _tar_member(tar, layer_name.split("/")[0], kind=tarfile.DIRTYPE)
        _tar_member(tar, layer_name, kind=tarfile.REGTYPE, data=layer, mode=0o644)
        _tar_member(tar, config_name, kind=tarfile.REGTYPE, data=config, mode=0o644)
        _tar_member(tar, "manifest.json", kind=tarfile.REGTYPE, data=manifest, mode=0o644)
    return path


# --- the daemon -------------------------------------------------------------------------------------------


#: NRI's timeouts, written out at upstream's defaults (github.com/containerd/nri pkg/api/timeouts.go): a
#: plugin has 5 s to register once connected and 2 s to answer each call, past which containerd drops it
NRI_REGISTRATION_TIMEOUT = "5s"
NRI_REQUEST_TIMEOUT = "2s"


def render_config(
    base: Path,
    sandbox_image: str = PAUSE_IMAGE,
    snapshotter: str = "native",
    private_cdi: bool = True,
    nri_socket: Path | None = None,
) -> str:
    """containerd 2's TOML configuration (version 3), with every path under ``base``. Images unpack for
    ``snapshotter``: ``native`` (a copy of the image per container: nothing to mount, fine for busybox)
    or ``overlayfs`` (for images the size of gpushare's, which a copy per container would slow down).
    CDI specs are read from ``base``/cdi with ``private_cdi``, else from containerd's defaults
    (/etc/cdi and /var/run/cdi, as on a real host). NRI takes external plugins on ``nri_socket``
    (``base``/nri.sock by default; containerd's own default, /var/run/nri/nri.sock, would be shared by
    every containerd on the machine), and launches none of its own (its plugin folders are under ``base``)."""
    images, runtime = "plugins.'io.containerd.cri.v1.images'", "plugins.'io.containerd.cri.v1.runtime'"
    return "\n".join(
        [
            "version = 3",
            f"root = '{base / 'root'}'",
            f"state = '{base / 'state'}'",
            "disabled_plugins = ["
            "'io.containerd.snapshotter.v1.btrfs', 'io.containerd.snapshotter.v1.devmapper', "
            "'io.containerd.snapshotter.v1.zfs', 'io.containerd.snapshotter.v1.erofs', "
            "'io.containerd.tracing.processor.v1.otlp', 'io.containerd.internal.v1.tracing']",
            "[grpc]",
            f"  address = '{base / 'containerd.sock'}'",
            "[ttrpc]",
            f"  address = '{base / 'containerd.sock.ttrpc'}'",
            "[debug]",
            "  address = ''",
            "[metrics]",
            "  address = ''",
            "[plugins.'io.containerd.internal.v1.opt']",
            f"  path = '{base / 'opt'}'",
            f"[{images}]",
            f"  snapshotter = '{snapshotter}'",
            f"[{images}.pinned_images]",
            f"  sandbox = '{sandbox_image}'",
            f"[{runtime}]",
            "  restrict_oom_score_adj = true",
            # pods' network namespaces are mounted under ``base`` (removed with it), not in /run/netns
            "  netns_mounts_under_state_dir = true",
            "  enable_selinux = false",
            # the DRA kubelet plugin writes its CDI specs where containerd reads them
            "  enable_cdi = true",
            *([f"  cdi_spec_dirs = ['{base / 'cdi'}']"] if private_cdi else []),
            f"[{runtime}.containerd]",
            "  default_runtime_name = 'runc'",
            f"[{runtime}.containerd.runtimes.runc]",
            "  runtime_type = 'io.containerd.runc.v2'",
            f"[{runtime}.cni]",
            f"  bin_dirs = ['{base / 'cni-bin'}']",
            f"  conf_dir = '{base / 'cni-conf'}'",
            "[plugins.'io.containerd.nri.v1.nri']",
            "  disable = false",
            f"  socket_path = '{nri_socket or base / 'nri.sock'}'",
            f"  plugin_path = '{base / 'nri-plugins'}'",
            f"  plugin_config_path = '{base / 'nri-conf'}'",
            f"  plugin_registration_timeout = '{NRI_REGISTRATION_TIMEOUT}'",
            f"  plugin_request_timeout = '{NRI_REQUEST_TIMEOUT}'",
            "",
        ]
    )


class Containerd:
    """One containerd process serving CRI on a private socket under ``base``."""

    def __init__(
        self,
        base: Path,
        sandbox_image: str = PAUSE_IMAGE,
        command_prefix: Sequence[str] = (),
        snapshotter: str = "native",
        private_cdi: bool = True,
        nri_socket: Path | None = None,
    ) -> None:
        self.base = base
        self.private_cdi = private_cdi
        #: where NRI plugins connect
        self.nri_socket = nri_socket or base / "nri.sock"
        self.sandbox_image = sandbox_image
        self.snapshotter = snapshotter
        #: run containerd through this, e.g. ``nsenter --mount=...`` to start it in a node's mount namespace
        self.command_prefix = tuple(command_prefix)
        self.socket = base / "containerd.sock"
        self.config = base / "config.toml"
        self.log_path = base / "containerd.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """The gRPC target, ``unix:///...``."""
        return f"unix://{self.socket}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float = 30.0) -> None:
        """Start containerd and return once it answers CRI Version."""
        if self.running:
            return
        self.base.mkdir(parents=True, exist_ok=True)
        self.config.write_text(
            render_config(self.base, self.sandbox_image, self.snapshotter, self.private_cdi, self.nri_socket)
        )
        with self.log_path.open("ab") as log_file:
            self._process = subprocess.Popen(
                [*self.command_prefix, str(binaries.built("containerd")), "--config", str(self.config)],
                env={**os.environ, "PATH": binaries.path_with_bin_dir()},
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            self._wait_ready(timeout)
        except ContainerdError:
            self.stop()
            raise
        log.info("containerd %d serving CRI on %s", self._process.pid, self.address)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            stub = cri_pb2_grpc.RuntimeServiceStub(channel)
            while True:
                if self._process is None or self._process.poll() is not None:
                    raise ContainerdError(
                        f"containerd exited during start-up; see {self.log_path}:\n{log_tail(self.log_path, 20)}"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ContainerdError(f"containerd did not answer within {timeout}s; see {self.log_path}")
                try:
                    stub.Version(cri_pb2.VersionRequest(), timeout=min(remaining, 1.0), wait_for_ready=True)
                    return
                except grpc.RpcError:
                    continue

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the daemon (SIGTERM, then SIGKILL). Running containers keep running, as with any
        containerd restart; :meth:`close` removes them too."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.info("containerd %d stopped", process.pid)

    def restart(self, timeout: float = 30.0) -> None:
        self.stop()
        self.start(timeout)

    def import_image(self, tarball: Path) -> None:
        """Load an image archive (docker or OCI) into the CRI namespace, unpacked for the snapshotter."""
        result = subprocess.run(
            [
                str(binaries.built("ctr")),
                "-a",
                str(self.socket),
                "-n",
                K8S_NAMESPACE,
                "images",
                "import",
                # containerd 2's transfer service unpacks only for the snapshotters it is configured for
                "--local",
                "--snapshotter",
                self.snapshotter,
                str(tarball),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise ContainerdError(f"ctr images import {tarball} failed: {result.stderr.strip()}")

    def remove_all_pods(self, timeout: float = 30.0) -> None:
        """Stop and remove every pod sandbox (and so every container and runc shim)."""
        with grpc.insecure_channel(self.address) as channel:
            stub = cri_pb2_grpc.RuntimeServiceStub(channel)
            for sandbox in stub.ListPodSandbox(cri_pb2.ListPodSandboxRequest(), timeout=timeout).items:
                stub.StopPodSandbox(cri_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=timeout)
                stub.RemovePodSandbox(cri_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=timeout)

    def shim_pids(self) -> list[int]:
        """The runc shims this daemon started. They leave its session on start, so stopping the daemon
        doesn't reach them; each names its daemon's socket with ``-address``."""
        wanted = str(self.socket).encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[0].endswith(b"containerd-shim-runc-v2") and wanted in argv:
                pids.append(int(entry.name))
        return pids

    def close(self) -> None:
        """Remove every pod, stop the daemon, end any shim left behind and delete its directory."""
        if self.running:
            with contextlib.suppress(grpc.RpcError):
                self.remove_all_pods()
        self.stop()
        for shim in self.shim_pids():
            for pid in [*descendants(shim), shim]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.base, ignore_errors=True)


def descendants(root: int) -> list[int]:
    """Every process below ``root``, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, queue = [], [root]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


@contextlib.contextmanager
def running_containerd(
    base: Path,
    images: Sequence[str] = (PAUSE_IMAGE, TEST_IMAGE),
    nri_socket: Path | None = None,
    snapshotter: str = "native",
) -> Iterator[Containerd]:
    """A started containerd holding the busybox image under every name in ``images``; closed on exit."""
    daemon = Containerd(base, sandbox_image=images[0], nri_socket=nri_socket, snapshotter=snapshotter)
    try:
        daemon.start()
        daemon.import_image(build_busybox_image(base / "busybox.tar", images))
        yield daemon
    finally:
        daemon.close()
