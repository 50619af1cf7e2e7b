"""Wiring for a running NRI plugin: the decision (shared with the CRI shim), the handler, and a thread
with its own asyncio loop holding the session with containerd, connecting again with back-off when
containerd restarts (:func:`gpushare.nriplugin.session.run_forever`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from gpushare.nriplugin.handler import Evict, Handler
from gpushare.nriplugin.session import run_forever

from gpushare.enforcement.decide import Enforcer
from gpushare.enforcement.wiring import build_enforcer
from gpushare.gpus.backend import GpuBackend
from gpushare.kube.nodeapi import NodeApi
from gpushare.pb import cri_pb2, cri_pb2_grpc
from gpushare.settings import NodeSettings, ShimSettings

log = logging.getLogger(__name__)

COMPONENT = "gpushare-nri-plugin"
#: seconds an eviction's StopContainer may take (no grace period: the runtime kills at once)
EVICT_TIMEOUT = 30.0
#: seconds :meth:`RunningPlugin.stop` waits for the session's thread
STOP_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class NriSettings:
    """Where the runtime's NRI socket is, and what the plugin registers as."""

    socket: str
    name: str
    index: str


def cri_evictor(runtime: str) -> Evict:
    """Stop a container through the runtime's CRI service with no grace period, as containerd's own NRI
    eviction does (see :mod:`gpushare.nriplugin.handler`); grpc.RpcError when it fails."""

    def evict(container_id: str) -> None:
        with grpc.insecure_channel(runtime) as channel:
            request = cri_pb2.StopContainerRequest(container_id=container_id, timeout=0)
            cri_pb2_grpc.RuntimeServiceStub(channel).StopContainer(request, timeout=EVICT_TIMEOUT)

    return evict


class RunningPlugin:
    """The session's thread: alive while it runs, ready while the runtime has the plugin configured."""

    def __init__(self, handler: Handler, nri: NriSettings) -> None:
        self.handler = handler
        self._nri = nri
        self._loop = asyncio.new_event_loop()
        self._session: Future[None] | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="nri-plugin", daemon=True)

    def start(self) -> RunningPlugin:
        self._thread.start()
        session = run_forever(Path(self._nri.socket), self._nri.name, self._nri.index, self.handler)
        self._session = asyncio.run_coroutine_threadsafe(session, self._loop)
        return self

    def alive(self) -> bool:
        return self._thread.is_alive() and self._session is not None and not self._session.done()

    def ready(self) -> bool:
        return self.alive() and self.handler.registered

    def audited(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the check of the running containers that Synchronize started."""
        asyncio.run_coroutine_threadsafe(self.handler.audited(), self._loop).result(timeout)

    def stop(self) -> None:
        """End the session (its connection closed as it unwinds) and the loop."""
        if self._thread.is_alive():
            with contextlib.suppress(TimeoutError):
                asyncio.run_coroutine_threadsafe(_cancel_others(), self._loop).result(STOP_TIMEOUT)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(STOP_TIMEOUT)
        if not self._thread.is_alive():
            self._loop.close()


async def _cancel_others() -> None:
    """Cancel every task of the running loop but this one, and wait for them to unwind."""
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


def start_nri_plugin(
    node: NodeSettings,
    settings: ShimSettings,
    nri: NriSettings,
    backend: GpuBackend,
    api: Any | None,
    shared: NodeApi | None,
) -> RunningPlugin:
    """Start the plugin's session thread. ``settings``: the decision's flags, shared with the CRI shim
    (its ``runtime`` is the CRI socket evictions go to); ``shared``: the node's pod watch and Event
    recorder (API lookups need ``settings.allow_api_fetch`` too)."""
    enforcer, _ = build_enforcer(Enforcer, node, settings, backend, api, shared, COMPONENT)
    limiting = any(card.limits_enforced for card in backend.cards())
    handler = Handler(enforcer, cri_evictor(settings.runtime), limiting)
    running = RunningPlugin(handler, nri).start()
    log.info(
        "NRI plugin %s-%s for node %s on %s: API lookups %s, memory limits %s",
        nri.index,
        nri.name,
        node.node_name,
        nri.socket,
        "on" if settings.allow_api_fetch else "off",
        "on" if limiting else "off",
    )
    return running
