"""The kubelet plugin of driver ``gpu.gpushare.io``: the registration service kubelet's plugin watcher
dials on ``<plugins_registry>/gpu.gpushare.io-reg.sock``, and the DRA v1 service it then calls on
``<plugins>/gpu.gpushare.io/dra.sock``. Thin: what a claim needs is :mod:`gpushare.draplugin.prepare`."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from gpushare.draplugin.cdi import DEFAULT_SPEC_DIR, prepared_memory, remove_spec, write_spec
from gpushare.draplugin.prepare import prepare_claim

from gpushare.cards import Card
from gpushare.contract.errors import ContractError
from gpushare.contract.names import DRA_DRIVER
from gpushare.contract.resourceclaim import ClaimError, ClaimRef
from gpushare.kube.errors import KubeError
from gpushare.kube.objects import get_resource_claim
from gpushare.pb import dra_pb2 as pb
from gpushare.pb import dra_pb2_grpc as pb_grpc
from gpushare.pb import pluginregistration_pb2 as reg_pb
from gpushare.pb import pluginregistration_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin",)
DEFAULT_KUBELET_ROOT = Path("/var/lib/kubelet")

#: reads a claim from the API server as a plain dict; raises KubeError
ClaimSource = Callable[[ClaimRef], dict[str, Any]]


def api_claims(api: Any) -> ClaimSource:
    """Claims read from the API server through ``api`` (a kubernetes ApiClient)."""
    return lambda ref: get_resource_claim(api, ref.namespace, ref.name)


@dataclass(frozen=True, slots=True)
class PluginPaths:
    """Where the plugin's sockets and CDI specs go, from kubelet's root directory."""

    kubelet_root: Path = DEFAULT_KUBELET_ROOT
    cdi_dir: Path = DEFAULT_SPEC_DIR

    @property
    def registration_socket(self) -> Path:
        return self.kubelet_root / "plugins_registry" / f"{DRA_DRIVER}-reg.sock"

    @property
    def dra_socket(self) -> Path:
        return self.kubelet_root / "plugins" / DRA_DRIVER / "dra.sock"


class RegistrationService(reg_grpc.RegistrationServicer):
    def __init__(self, endpoint: Path) -> None:
        self._endpoint = endpoint
        self.registered = threading.Event()

    def GetInfo(self, request: reg_pb.InfoRequest, context: grpc.ServicerContext) -> reg_pb.PluginInfo:
        return reg_pb.PluginInfo(
            type=PLUGIN_TYPE, name=DRA_DRIVER, endpoint=str(self._endpoint), supported_versions=SUPPORTED_VERSIONS
        )

    def NotifyRegistrationStatus(
        self, request: reg_pb.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg_pb.RegistrationStatusResponse:
        if request.plugin_registered:
            log.info("kubelet registered DRA driver %s at %s", DRA_DRIVER, self._endpoint)
            self.registered.set()
        else:
            log.error("kubelet refused DRA driver %s: %s", DRA_DRIVER, request.error)
            self.registered.clear()
        return reg_pb.RegistrationStatusResponse()


class DraService(pb_grpc.DRAPluginServicer):
    """Prepares each claim by writing its CDI spec; a claim that can't be prepared gets its own error
    (kubelet retries it), the others are prepared regardless. The specs written are the record of what
    the prepared claims hold: read before each claim is prepared (one at a time), so that no card is
    prepared past its memory, after a restart too."""

    def __init__(
        self, node: str, cards: Callable[[], Sequence[Card]], unit_mib: int, source: ClaimSource, cdi_dir: Path
    ) -> None:
        self._node = node
        self._cards = cards
        self._unit_mib = unit_mib
        self._source = source
        self._cdi_dir = cdi_dir
        self._lock = threading.Lock()

    def NodePrepareResources(
        self, request: pb.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> pb.NodePrepareResourcesResponse:
        return pb.NodePrepareResourcesResponse(claims={c.uid: self._prepare(_ref(c)) for c in request.claims})

    def NodeUnprepareResources(
        self, request: pb.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> pb.NodeUnprepareResourcesResponse:
        return pb.NodeUnprepareResourcesResponse(claims={c.uid: self._unprepare(_ref(c)) for c in request.claims})

    def _prepare(self, ref: ClaimRef) -> pb.NodePrepareResourceResponse:
        try:
            claim = self._source(ref)
            with self._lock:
                held = prepared_memory(self._cdi_dir)
                prepared = prepare_claim(claim, ref, self._node, self._cards(), self._unit_mib, held)
                write_spec(self._cdi_dir, ref.uid, prepared.spec)
        except (ContractError, KubeError, OSError) as exc:
            message = str(exc) if isinstance(exc, ClaimError) else f"ResourceClaim {ref}: {exc}"
            log.error("not preparing %s", message)
            return pb.NodePrepareResourceResponse(error=message)
        for d in prepared.devices:
            log.info("prepared ResourceClaim %s request %s: %s as %s", ref, d.request, d.device, d.cdi_device_id)
        return pb.NodePrepareResourceResponse(
            devices=[
                pb.Device(
                    request_names=[d.request],
                    pool_name=d.pool,
                    device_name=d.device,
                    cdi_device_ids=[d.cdi_device_id],
                    share_id=d.share_id,
                )
                for d in prepared.devices
            ]
        )

    def _unprepare(self, ref: ClaimRef) -> pb.NodeUnprepareResourceResponse:
        try:
            removed = remove_spec(self._cdi_dir, ref.uid)
        except OSError as exc:
            log.error("not unpreparing ResourceClaim %s: %s", ref, exc)
            return pb.NodeUnprepareResourceResponse(error=f"ResourceClaim {ref}: {exc}")
        log.info("unprepared ResourceClaim %s%s", ref, "" if removed else " (it was not prepared)")
        return pb.NodeUnprepareResourceResponse()


def _ref(claim: pb.Claim) -> ClaimRef:
    return ClaimRef(namespace=claim.namespace, name=claim.name, uid=claim.uid)


def _serve(path: Path, add: Callable[[grpc.Server], None], name: str) -> grpc.Server:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=name))
    add(server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    os.chmod(path, 0o600)
    return server


class DraPlugin:
    """Serves the DRA service, then the registration socket (whose appearance registers the plugin with
    kubelet); :meth:`stop` removes the registration socket first, which deregisters it."""

    def __init__(self, paths: PluginPaths, service: DraService) -> None:
        self.paths = paths
        self.registration = RegistrationService(paths.dra_socket)
        self._service = service
        self._servers: list[tuple[grpc.Server, Path]] = []

    def start(self) -> None:
        try:
            dra = _serve(
                self.paths.dra_socket, lambda s: pb_grpc.add_DRAPluginServicer_to_server(self._service, s), "dra"
            )
            self._servers.append((dra, self.paths.dra_socket))
            reg = _serve(
                self.paths.registration_socket,
                lambda s: reg_grpc.add_RegistrationServicer_to_server(self.registration, s),
                "dra-reg",
            )
            self._servers.insert(0, (reg, self.paths.registration_socket))
        except BaseException:
            self.stop()
            raise
        log.info("DRA driver %s serving %s", DRA_DRIVER, self.paths.dra_socket)

    def alive(self) -> bool:
        """Both sockets are served and still in place (a removed one is served again on restart)."""
        return bool(self._servers) and all(path.is_socket() for _, path in self._servers)

    def ready(self) -> bool:
        return self.alive() and self.registration.registered.is_set()

    def stop(self) -> None:
        servers, self._servers = self._servers, []
        for server, path in servers:
            path.unlink(missing_ok=True)
            server.stop(grace=0.5).wait()
