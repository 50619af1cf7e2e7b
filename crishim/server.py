"""The CRI shim's gRPC server: every call is forwarded to the runtime, CreateContainer is checked first."""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from crishim.assignment import Resolver, Target
from crishim.metrics import CORRECTIONS, REFUSALS
from crishim.proxy import MESSAGE_OPTIONS, Forwarder, Upstream
from crishim.rewrite import RewriteOptions, rewrite
from gpushare.cards import Card
from gpushare.contract import ENV_VISIBLE_DEVICES, VISIBLE_DEVICES_VOID, MemoryUnit
from gpushare.pb import cri_pb2

log = logging.getLogger(__name__)

CREATE_CONTAINER = "/runtime.v1.RuntimeService/CreateContainer"
EVENT_CORRECTED = "GPUAssignmentCorrected"
EVENT_REFUSED = "GPUAssignmentRefused"

#: (pod, reason, message, type) -> records a Kubernetes Event; must not block
EventSink = Callable[[Target, str, str, str], None]


def socket_path(listen: str) -> Path:
    """``unix:///run/x.sock``, ``unix:/run/x.sock`` or a bare path."""
    for prefix in ("unix://", "unix:"):
        if listen.startswith(prefix):
            listen = listen[len(prefix) :]
            break
    if not listen.startswith("/"):
        raise ValueError(f"--listen {listen!r}: expected an absolute unix socket path")
    return Path(listen)


class CreateContainerGuard:
    """Decode CreateContainer, resolve and enforce the container's card assignment, re-encode."""

    def __init__(
        self,
        resolver: Resolver,
        cards: Callable[[], Sequence[Card]],
        unit: MemoryUnit,
        options: RewriteOptions,
        events: EventSink | None = None,
    ) -> None:
        self._resolver = resolver
        self._cards = cards
        self._unit = unit
        self._options = options
        self._events = events

    def __call__(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            decoded = cri_pb2.CreateContainerRequest.FromString(request)
        except DecodeError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"CreateContainer request can't be decoded: {exc}")
        cards = list(self._cards())
        assignment = self._resolver.resolve(decoded, cards)
        outcome = rewrite(decoded.config, assignment, cards, self._unit, self._options)
        if outcome.refusal is not None:
            REFUSALS.labels(outcome.refusal.reason).inc()
            log.warning("refused CreateContainer (%s): %s", outcome.refusal.reason, outcome.refusal.message)
            self._event(assignment.target, EVENT_REFUSED, outcome.refusal.message, "Warning")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, outcome.refusal.message)
        if outcome.config is None:
            return request
        if outcome.reason:
            CORRECTIONS.labels(outcome.reason).inc()
            log.warning("corrected CreateContainer (%s): %s", outcome.reason, outcome.message)
            self._event(assignment.target, EVENT_CORRECTED, outcome.message, "Warning")
        else:
            log.debug("%s requests no GPU: %s=%s", assignment.target, ENV_VISIBLE_DEVICES, VISIBLE_DEVICES_VOID)
        decoded.config.CopyFrom(outcome.config)
        return decoded.SerializeToString()

    def _event(self, target: Target, reason: str, message: str, type_: str) -> None:
        if self._events is not None:
            self._events(target, reason, message, type_)


class CriShim:
    """A gRPC server on a unix socket (mode 0600) forwarding to ``runtime``."""

    def __init__(self, listen: str, runtime: str, guard: CreateContainerGuard, workers: int = 64) -> None:
        self.path = socket_path(listen)
        self.runtime = runtime
        self._upstream = Upstream(runtime)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cri-shim"),
            handlers=[Forwarder(self._upstream, {CREATE_CONTAINER: guard})],
            options=MESSAGE_OPTIONS,
            maximum_concurrent_rpcs=None,
        )
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
        private = Path(tempfile.mkdtemp(prefix=".cri-shim-", dir=self.path.parent))
        try:
            staging = private / "sock"
            if self._server.add_insecure_port(f"unix:{staging}") == 0:
                raise OSError(f"could not listen on {self.path}")
            os.chmod(staging, 0o600)
            os.rename(staging, self.path)
        finally:
            private.rmdir()
        self._server.start()
        self.serving = True
        log.info("CRI shim listening on %s, forwarding to %s", self.address, self.runtime)

    def stop(self, grace: float | None = 1.0) -> None:
        self.serving = False
        self._server.stop(grace).wait()
        self._upstream.close()
        if self.path.exists() and stat.S_ISSOCK(self.path.lstat().st_mode):
            self.path.unlink()

    def wait(self) -> None:
        self._server.wait_for_termination()
