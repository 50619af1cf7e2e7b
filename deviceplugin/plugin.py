"""The device plugin's lifecycle: serve both resources, register with kubelet, and do it again
whenever kubelet restarts.

Kubelet deletes every socket in its device-plugins directory when it restarts and creates a new
``kubelet.sock``. A watchdog notices either (our socket gone, or kubelet.sock replaced) and
re-serves and re-registers at once: it wakes on the directory's inotify events rather than polling it
(a poll every 200 ms left that long a window in which a new kubelet admits pods with no plugin). The
wipe can also land while the plugin is starting (between binding a socket and tightening its mode,
say); anything in the directory vanishing then is the same event, and the next round serves and
registers again. Whether a kubelet is watching (its ListAndWatch streams open) is reported through
``on_watch`` the moment it changes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from gpushare.deviceplugin.allocator import Allocator
from gpushare.deviceplugin.server import DeviceState, ResourceService
from inotify_simple import INotify, flags

from gpushare.cards import Card
from gpushare.contract.names import RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.units import MemoryUnit
from gpushare.gpus.backend import GpuBackend, HealthEvent
from gpushare.pb import deviceplugin_pb2 as pb
from gpushare.pb import deviceplugin_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
SOCKETS = {RESOURCE_MEM: "gpushare-gpu-mem.sock", RESOURCE_COUNT: "gpushare-gpu-count.sock"}
#: the longest the watchdog sleeps without an inotify event (a safety net)
WATCH_INTERVAL = 0.5
#: the pause after a failed round, whose own socket events would otherwise wake the watchdog at once
RETRY_INTERVAL = 0.2
_DIRECTORY_EVENTS = flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO | flags.ATTRIB


class DirectoryWatch:
    """Wakes when anything in a directory is created, deleted, moved or changed, when :meth:`wake` is
    called (stop), or after a timeout."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._inotify = INotify()
        self._woken = os.eventfd(0, os.EFD_NONBLOCK)
        self._watch: int | None = None

    def wait(self, timeout: float) -> None:
        if self._watch is None:
            with contextlib.suppress(OSError):  # the directory is being re-created: look again next time
                self._watch = self._inotify.add_watch(self._dir, _DIRECTORY_EVENTS)
        ready, _, _ = select.select([self._inotify, self._woken], [], [], timeout)
        if self._woken in ready:
            os.eventfd_read(self._woken)
        if self._inotify in ready:
            for event in self._inotify.read(timeout=0):
                if event.mask & flags.IGNORED:  # the directory itself went
                    self._watch = None

    def wake(self) -> None:
        os.eventfd_write(self._woken, 1)

    def close(self) -> None:
        self._inotify.close()
        os.close(self._woken)


def _file_identity(path: Path) -> tuple[int, int] | None:
    """Inode and change time: a re-created file may get the freed inode back, but not both."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


def _restrict(path: Path) -> None:
    """Only root (kubelet) may connect to a plugin socket."""
    os.chmod(path, 0o600)


@dataclass
class _Served:
    resource: str
    service: ResourceService
    server: grpc.Server
    socket: Path


class DevicePlugin:
    def __init__(
        self,
        directory: Path,
        backend: GpuBackend,
        allocator: Allocator,
        unit: MemoryUnit,
        count_replicas: int = 0,
        on_watch: Callable[[bool], None] = lambda _watching: None,
    ) -> None:
        self._dir = Path(directory)
        self._on_watch = on_watch
        self._backend = backend
        self._allocator = allocator
        self._unit = unit
        self._count_replicas = count_replicas
        self.state = DeviceState(backend.cards)
        self._served: list[_Served] = []
        self._kubelet_identity: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._registered = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch = DirectoryWatch(self._dir)
        self.registrations = 0
        backend.subscribe(self._on_health)

    # --- public --------------------------------------------------------------------------------------

    def start(self) -> None:
        """Serve and keep registered (in the background) until :meth:`stop`."""
        self._dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="device-plugin", daemon=True)
        self._thread.start()

    def wait_registered(self, timeout: float) -> bool:
        return self._registered.wait(timeout)

    @property
    def registered(self) -> bool:
        return self._registered.is_set()

    def alive(self) -> bool:
        """The serving thread runs (it keeps the plugin registered)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._watch.wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._watch.close()
        self._backend.unsubscribe(self._on_health)
        self._shutdown()
        self.state.close()

    def cards(self) -> Sequence[Card]:
        return self._backend.cards()

    # --- internals -------------------------------------------------------------------------------------

    def _on_health(self, event: HealthEvent) -> None:
        self.state.bump()
        self._allocator.publish_usage()

    def _serve(self) -> None:
        for resource, name in SOCKETS.items():
            path = self._dir / name
            path.unlink(missing_ok=True)
            service = ResourceService(
                resource, self.state, self._allocator, self._unit, self._count_replicas, self._on_watch
            )
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"dp-{name}"))
            pb_grpc.add_DevicePluginServicer_to_server(service, server)
            server.add_insecure_port(f"unix://{path}")
            self._served.append(_Served(resource, service, server, path))
            server.start()
            _restrict(path)

    def _shutdown(self) -> None:
        served, self._served = self._served, []
        for s in served:
            s.service.stop()
            s.server.stop(grace=0.5)
            s.socket.unlink(missing_ok=True)
        self._registered.clear()

    def _register(self) -> None:
        kubelet = self._dir / KUBELET_SOCKET
        with grpc.insecure_channel(f"unix://{kubelet}") as channel:
            stub = pb_grpc.RegistrationStub(channel)
            for s in self._served:
                stub.Register(
                    pb.RegisterRequest(
                        version=API_VERSION,
                        endpoint=s.socket.name,
                        resource_name=s.resource,
                        options=pb.DevicePluginOptions(get_preferred_allocation_available=True),
                    ),
                    timeout=5,
                )
                log.info("registered %s with kubelet at %s (endpoint %s)", s.resource, kubelet, s.socket.name)
        self._kubelet_identity = _file_identity(kubelet)
        self.registrations += 1
        self._registered.set()

    def _needs_restart(self) -> bool:
        if not self._served or not self._registered.is_set():
            return True
        if any(not s.socket.exists() for s in self._served):
            log.warning("our sockets in %s vanished (kubelet restarted?); serving again", self._dir)
            return True
        if _file_identity(self._dir / KUBELET_SOCKET) != self._kubelet_identity:
            log.warning("kubelet.sock in %s was re-created; registering again", self._dir)
            return True
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            if (self._dir / KUBELET_SOCKET).exists() and self._needs_restart():
                try:
                    self._shutdown()
                    self._serve()
                    self._register()
                except grpc.RpcError as exc:
                    log.warning("registration with kubelet failed (%s); retrying", exc.details() or exc.code())
                    self._registered.clear()
                    # our own sockets' events would wake the watch at once: retry no faster than this
                    self._stop.wait(RETRY_INTERVAL)
                except (OSError, RuntimeError) as exc:  # RuntimeError: gRPC could not bind the socket
                    log.warning(
                        "%s changed while the plugin was starting (%s): kubelet restarted? serving again",
                        self._dir,
                        exc,
                    )
                    self._shutdown()
                    self._stop.wait(RETRY_INTERVAL)
            self._watch.wait(WATCH_INTERVAL)
