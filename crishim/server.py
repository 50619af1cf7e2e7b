"""The CRI shim's listener: each kubelet connection is spliced onto its own runtime connection, and
CreateContainer requests are checked before they go on (and, where limits are set, a sandbox's end
clears them: :mod:`gpushare.crishim.ending`)."""

from __future__ import annotations

import logging
import os
import select
import socket
import stat
import tempfile
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from gpushare.crishim.ending import SANDBOX_ENDS, SandboxEnd
from gpushare.crishim.metrics import CORRECTIONS, REFUSALS
from gpushare.crishim.reactor import Reactor
from gpushare.crishim.resolve import Resolution, Resolver, Target
from gpushare.crishim.rewrite import rewrite
from gpushare.crishim.splice import INTERCEPTED, Forward, Refuse, Splice, Verdict

from gpushare.assignment import Refusal, describe
from gpushare.cards import Card
from gpushare.contract.names import ENV_VISIBLE_DEVICES, VISIBLE_DEVICES_VOID
from gpushare.contract.resourceclaim import ClaimError
from gpushare.contract.units import MemoryUnit
from gpushare.memlimits.enforcer import PodLimiter
from gpushare.pb import cri_pb2
from gpushare.settings import RewriteOptions, socket_path

log = logging.getLogger(__name__)

EVENT_CORRECTED = "GPUAssignmentCorrected"
EVENT_REFUSED = "GPUAssignmentRefused"
#: the refusal reason (and metric label) of a pod whose memory limit the driver did not set
MEMORY_LIMIT = "memory-limit"
LISTEN_BACKLOG = 128
#: threads settling CreateContainer calls (each may wait on the API server)
DECIDE_WORKERS = 8
#: threads forwarding the StopPodSandbox and RemovePodSandbox calls that clear a pod's limits (each waits
#: for the runtime to stop the sandbox)
END_WORKERS = 8
#: connecting to the runtime's unix socket is immediate unless its backlog is full
CONNECT_TIMEOUT = 0.5

#: (pod, reason, message, type) -> records a Kubernetes Event; must not block
EventSink = Callable[[Target, str, str, str], None]


@dataclass(frozen=True, slots=True)
class CreateContainerGuard:
    """Decode CreateContainer, resolve and enforce the container's card assignment, re-encode."""

    resolver: Resolver
    cards: Callable[[], Sequence[Card]]
    unit: MemoryUnit
    options: RewriteOptions
    events: EventSink | None = None
    #: sets the pod's GPU memory limits before its GPU containers are created (None: limits are off)
    limiter: PodLimiter | None = None

    def __call__(self, request: bytes) -> Verdict:
        try:
            decoded = cri_pb2.CreateContainerRequest.FromString(request)
        except DecodeError as exc:
            return Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"CreateContainer request can't be decoded: {exc}")
        cards = list(self.cards())
        resolution = self.resolver.resolve(decoded, cards)
        outcome = rewrite(decoded.config, resolution, cards, self.unit, self.options)
        refusal = outcome.refusal or self._limit(decoded, resolution, cards)
        if refusal is not None:
            REFUSALS.labels(refusal.reason).inc()
            log.warning("refused CreateContainer (%s): %s", refusal.reason, refusal.message)
            self._event(resolution.target, EVENT_REFUSED, refusal.message, "Warning")
            return Refuse(grpc.StatusCode.FAILED_PRECONDITION, refusal.message)
        if outcome.config is None:
            if resolution.wants_gpu:
                log.info("%s: %s as assigned (%s)", resolution.target, describe(resolution.slices), resolution.source)
            return Forward(request)
        if outcome.reason:
            CORRECTIONS.labels(outcome.reason).inc()
            log.warning("corrected CreateContainer (%s): %s", outcome.reason, outcome.message)
            self._event(resolution.target, EVENT_CORRECTED, outcome.message, "Warning")
        elif resolution.dra_env is not None:
            log.info(
                "%s: GPU from its ResourceClaims (CDI device(s) %s): %s",
                resolution.target,
                ", ".join(resolution.dra_devices),
                " ".join(f"{k}={v}" for k, v in resolution.dra_env.items()),
            )
        else:
            log.debug("%s requests no GPU: %s=%s", resolution.target, ENV_VISIBLE_DEVICES, VISIBLE_DEVICES_VOID)
        decoded.config.CopyFrom(outcome.config)
        return Forward(decoded.SerializeToString())

    def _limit(
        self, request: cri_pb2.CreateContainerRequest, resolution: Resolution, cards: Sequence[Card]
    ) -> Refusal | None:
        """Hold the pod to its share of each card it shares (through the device plugin and its
        ResourceClaims), before its GPU container is created."""
        if self.limiter is None or not resolution.wants_gpu or not any(card.limits_enforced for card in cards):
            return None
        annotations = request.sandbox_config.annotations
        try:
            held = self.resolver.pod_held(resolution, annotations, cards)
        except ClaimError as exc:
            return Refusal(MEMORY_LIMIT, f"{resolution.target}: its memory limits can't be set: {exc}")
        why = self.limiter.apply(str(resolution.target), request.sandbox_config.linux.cgroup_parent, held, cards)
        return None if why is None else Refusal(MEMORY_LIMIT, why)

    def _event(self, target: Target, reason: str, message: str, type_: str) -> None:
        if self.events is not None:
            self.events(target, reason, message, type_)


class CriShim:
    """Listens on a unix socket (mode 0600) and splices every connection onto ``runtime``.

    While the runtime is down, connections are accepted and closed at once, which kubelet's gRPC
    client reports as UNAVAILABLE; once it is back, the next connection reaches it.
    """

    def __init__(
        self,
        listen: str,
        runtime: str,
        guard: CreateContainerGuard,
        sandbox_end: SandboxEnd | None = None,
    ) -> None:
        """``sandbox_end`` clears a pod's limits when its sandbox ends (None: those calls pass untouched)."""
        self.path = socket_path(listen)
        self.runtime = runtime
        self._runtime_path = str(socket_path(runtime))
        self._guard = guard
        self._sandbox_end = sandbox_end
        self._reactor = Reactor("cri-shim-io")
        self._pool = futures.ThreadPoolExecutor(max_workers=DECIDE_WORKERS, thread_name_prefix="cri-shim-decide")
        #: a sandbox's stop can take its pod's grace period: its own threads, so CreateContainer never waits
        self._end_pool = futures.ThreadPoolExecutor(max_workers=END_WORKERS, thread_name_prefix="cri-shim-end")
        self._pools: dict[bytes, futures.Executor] = dict.fromkeys(INTERCEPTED, self._pool)
        if sandbox_end is not None:
            self._pools.update(dict.fromkeys(SANDBOX_ENDS, self._end_pool))
        self._listener: socket.socket | None = None
        self._splices: set[Splice] = set()
        self._runtime_down = False
        self.serving = False

    @property
    def address(self) -> str:
        return f"unix://{self.path}"

    def start(self) -> None:
        """Bind in a private directory, tighten the mode, then move the socket into place: nobody can
        connect through a window of looser permissions."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise FileExistsError(f"--listen {self.path} exists and is not a socket")
            self.path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        private = Path(tempfile.mkdtemp(prefix=".cri-shim-", dir=self.path.parent))
        try:
            staging = private / "sock"
            listener.bind(str(staging))
            os.chmod(staging, 0o600)
            listener.listen(LISTEN_BACKLOG)
            os.rename(staging, self.path)
        except BaseException:
            listener.close()
            raise
        finally:
            for leftover in private.iterdir():
                leftover.unlink()
            private.rmdir()
        listener.setblocking(False)
        self._listener = listener
        self._reactor.register(listener.fileno(), select.EPOLLIN, self._accept)
        self._reactor.start()
        self.serving = True
        log.info("CRI shim listening on %s, forwarding to %s", self.address, self.runtime)

    def alive(self) -> bool:
        """Serving, and the I/O thread that relays every connection still runs."""
        return self.serving and self._reactor.alive

    def stop(self) -> None:
        if not self.serving:
            return
        self.serving = False
        self._reactor.call_soon(self._shut)
        self._reactor.stop()
        for pool in (self._pool, self._end_pool):  # calls under way hand their verdicts to nobody
            pool.shutdown(wait=True, cancel_futures=True)
        self._reactor.close()
        if self.path.exists() and stat.S_ISSOCK(self.path.lstat().st_mode):
            self.path.unlink()

    def _shut(self) -> None:
        assert self._listener is not None
        self._reactor.unregister(self._listener.fileno())
        self._listener.close()
        for splice in list(self._splices):
            splice.close()

    def _accept(self, _events: int) -> None:
        assert self._listener is not None
        while True:
            try:
                kubelet, _ = self._listener.accept()
            except BlockingIOError:
                return
            runtime = self._connect_runtime()
            if runtime is None:
                kubelet.close()
                continue
            splice = Splice(self._reactor, kubelet, runtime, self._decide, self._pools, self._splices.discard)
            self._splices.add(splice)

    def _decide(self, path: bytes, message: bytes) -> Verdict:
        if path in INTERCEPTED or self._sandbox_end is None:
            return self._guard(message)
        return self._sandbox_end(message)

    def _connect_runtime(self) -> socket.socket | None:
        runtime = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        runtime.settimeout(CONNECT_TIMEOUT)
        try:
            runtime.connect(self._runtime_path)
        except OSError as exc:
            runtime.close()
            if not self._runtime_down:
                log.warning("runtime %s unreachable (%s); answering UNAVAILABLE until it is back", self.runtime, exc)
            self._runtime_down = True
            return None
        if self._runtime_down:
            log.info("runtime %s reachable again", self.runtime)
            self._runtime_down = False
        return runtime
