"""One NRI plugin session with containerd, and reconnecting to it; the :class:`PluginHandler` protocol that
the plugin's decisions implement.

How a session goes (github.com/containerd/nri v0.11.0, pkg/stub/stub.go for the plugin's side and
pkg/adaptation/plugin.go and adaptation.go for the runtime's; containerd 2.2.9 is built with that version):

1. The plugin connects to the runtime's NRI socket and multiplexes it: the runtime calls the plugin's
   ``Plugin`` service on connection 1 and the plugin calls the runtime's ``Runtime`` service on
   connection 2 (:mod:`gpushare.ttrpc.mux`).
2. The plugin registers with its name and a two-digit index (plugins are called in index order). The
   runtime waits ``plugin_registration_timeout`` (5 s by default) for it.
3. The runtime calls ``Configure``: :meth:`PluginHandler.configure` names the events the plugin
   subscribes to. Then ``Synchronize`` hands over every existing pod and container
   (:meth:`PluginHandler.synchronize`); the runtime may split that over several requests, which the
   session gathers into one call.
4. From then on the runtime calls the subscribed events. Every call has ``plugin_request_timeout`` (2 s
   by default, sent in ``ConfigureRequest.request_timeout``) to be answered; past it the runtime
   *drops the plugin and goes on without it*, so a container would be created unadjusted. The session
   therefore answers ``CreateContainer`` with an error shortly before that deadline
   (:data:`ANSWER_MARGIN`) when the handler has not decided: the container is refused, not let through.
5. The session ends when the runtime closes the connection (containerd stopping or restarting), or
   when the task running it is cancelled. :func:`run_forever` connects again with back-off.

What the runtime does with the answers (containerd 2.2.9, checked by tests/nri/test_nri_containerd.py):

- an error from ``CreateContainer`` fails the CRI CreateContainer call with the same status code and the
  message wrapped: ``failed to create containerd container: failed to get NRI adjustment for container:
  rpc error: code = FailedPrecondition desc = <the ContainerRefused text>``;
- an adjustment's env additions and replacements, annotations, devices and CDI devices are applied. An
  env key marked for removal (``"-KEY"``) only undoes an earlier plugin's addition: NRI v0.11 merges the
  plugins' answers without the removals (pkg/adaptation/result.go), so the container's own variable
  stays; replace its value instead;
- evictions are dropped, whichever way they are sent: the runtime side passes on only the updates of
  ``UpdateContainers`` and merges ``CreateContainer`` answers without their ``evict`` list. The
  ``update`` of ``UpdateContainers`` (a running container's resources) is applied;
- errors from the pod sandbox events are only logged by containerd, and would stop the event from
  reaching plugins with a higher index, so the session logs a handler's failure there and answers OK;
- an error from the ``StartContainer`` event fails the CRI StartContainer call ("NRI container start
  failed"): containerd sends it once the container's task (and so its cgroup) exists and before the task
  starts (``internal/cri/server/container_start.go``), and NRI v0.11 hands a plugin's error back
  (``pkg/adaptation/plugin.go``, StateChange). :meth:`PluginHandler.start_container` refuses there.

The protocol below is the stable surface between this module and the plugin's decisions
(nriplugin/handler.py). Messages are the generated ``gpushare.pb.nri_pb2`` classes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Collection, Sequence
from pathlib import Path
from typing import NoReturn, Protocol, TypeVar

import grpc

from gpushare.kube.retry import Backoff
from gpushare.pb import nri_pb2
from gpushare.ttrpc.client import Client
from gpushare.ttrpc.errors import RemoteError, Status, TtrpcError
from gpushare.ttrpc.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, Mux
from gpushare.ttrpc.server import Method, Server

log = logging.getLogger(__name__)

T = TypeVar("T")

#: the events a :class:`PluginHandler` can subscribe to, as ``nri_pb2.Event`` values
HANDLED_EVENTS = frozenset(
    {nri_pb2.CREATE_CONTAINER, nri_pb2.START_CONTAINER, nri_pb2.STOP_POD_SANDBOX, nri_pb2.REMOVE_POD_SANDBOX}
)
#: how long before the runtime's request timeout the session answers for a handler that has not
#: decided, in seconds (never less than half the timeout)
ANSWER_MARGIN = 0.25
#: the runtime's timeouts until Configure tells the real ones (NRI's defaults, pkg/api/timeouts.go)
DEFAULT_REGISTRATION_TIMEOUT = 5.0
DEFAULT_REQUEST_TIMEOUT = 2.0
#: how long an UpdateContainers call may take; containerd applies the updates before it answers
UPDATE_TIMEOUT = 10.0
#: the back-off between connection attempts of :func:`run_forever`
RECONNECT_BACKOFF = Backoff(initial=0.5, maximum=30.0)

PLUGIN_SERVICE = nri_pb2.DESCRIPTOR.services_by_name["Plugin"].full_name
RUNTIME_SERVICE = nri_pb2.DESCRIPTOR.services_by_name["Runtime"].full_name


class ContainerRefused(Exception):
    """Raised by :meth:`PluginHandler.create_container` to refuse the container: containerd fails the
    CRI CreateContainer call with this message in its error."""


class SessionRefused(Exception):
    """The runtime would not take the plugin: registration or configuration failed, or it closed the
    connection before configuring it."""


class Runtime(Protocol):
    """The calls a handler may make to the runtime during a session."""

    async def update_containers(
        self,
        updates: Sequence[nri_pb2.ContainerUpdate] = (),
        evictions: Sequence[nri_pb2.ContainerEviction] = (),
    ) -> list[nri_pb2.ContainerUpdate]:
        """Ask the runtime to update containers now (and to evict some, which containerd 2.2.9 ignores);
        returns the updates that failed.
        Raises :class:`gpushare.ttrpc.errors.RemoteError` when the runtime answers with an error, and
        :class:`gpushare.ttrpc.errors.ConnectionLost` when the session ended.

        Never await this inside a handler call: the runtime holds its lock while it waits for the
        handler's answer, and takes the same lock to apply the update, so the two would wait for
        each other until the runtime drops the plugin. Start it as a task instead."""
        ...


class PluginHandler(Protocol):
    """The plugin's decisions. One session calls them one at a time for the container and pod events
    (the runtime serialises them), each under the runtime's request timeout."""

    async def configure(self, request: nri_pb2.ConfigureRequest, runtime: Runtime) -> Collection[int]:
        """The events to subscribe to, a subset of :data:`HANDLED_EVENTS`. Called once per session,
        first; ``runtime`` stays usable until the session ends. ``request`` has the runtime's name,
        version and timeouts (milliseconds)."""
        ...

    async def synchronize(
        self, pods: Sequence[nri_pb2.PodSandbox], containers: Sequence[nri_pb2.Container]
    ) -> Sequence[nri_pb2.ContainerUpdate]:
        """Every pod sandbox and container the runtime has, once per session after ``configure``; the
        answer's updates are applied by the runtime."""
        ...

    async def create_container(self, request: nri_pb2.CreateContainerRequest) -> nri_pb2.CreateContainerResponse:
        """The adjustment (env, annotations, devices, CDI devices) and updates for a container about to
        be created (evictions are dropped by containerd 2.2.9, see above). Raise :class:`ContainerRefused`
        to refuse it; any other exception refuses it too, as an internal error."""
        ...

    async def start_container(self, pod: nri_pb2.PodSandbox, container: nri_pb2.Container) -> None:
        """A container is about to start: its cgroup exists, its process doesn't run yet. Raise
        :class:`ContainerRefused` to fail the start (any other exception fails it too)."""
        ...

    async def stop_pod_sandbox(self, pod: nri_pb2.PodSandbox) -> None:
        """A pod sandbox was stopped (its containers are stopped)."""
        ...

    async def remove_pod_sandbox(self, pod: nri_pb2.PodSandbox) -> None:
        """A pod sandbox was removed."""
        ...

    async def shutdown(self) -> None:
        """The session ended: the runtime said it is shutting down, or the connection of a configured
        session closed (containerd stopped or crashed); called once for each, so it may come twice."""
        ...


def event_mask(events: Collection[int]) -> int:
    """The ``ConfigureResponse.events`` bits for ``events``: bit (event - 1) each (pkg/api/event.go)."""
    mask = 0
    for event in events:
        mask |= 1 << (event - 1)
    return mask


def check_index(index: str) -> None:
    """Refuse an index the runtime would refuse: two decimal digits (pkg/api/plugin.go)."""
    if len(index) != 2 or not all("0" <= digit <= "9" for digit in index):
        raise ValueError(f"NRI plugin index {index!r} is not two digits")


class _RuntimeLink:
    """:class:`Runtime` over the session's ttRPC client."""

    def __init__(self, client: Client) -> None:
        self._client = client

    async def update_containers(
        self,
        updates: Sequence[nri_pb2.ContainerUpdate] = (),
        evictions: Sequence[nri_pb2.ContainerEviction] = (),
    ) -> list[nri_pb2.ContainerUpdate]:
        reply = await self._client.call(
            RUNTIME_SERVICE,
            "UpdateContainers",
            nri_pb2.UpdateContainersRequest(update=updates, evict=evictions),
            nri_pb2.UpdateContainersResponse,
            timeout=UPDATE_TIMEOUT,
        )
        return list(reply.failed)


class _PluginService:
    """The ``Plugin`` service the runtime calls, answered through a :class:`PluginHandler`."""

    def __init__(self, handler: PluginHandler, runtime: Runtime, name: str) -> None:
        self._handler = handler
        self._runtime = runtime
        self._name = name
        self._request_timeout = DEFAULT_REQUEST_TIMEOUT
        self._pods: list[nri_pb2.PodSandbox] = []
        self._containers: list[nri_pb2.Container] = []
        #: set once Configure succeeded; why it failed otherwise
        self.configured = False
        self.failure: str | None = None

    def methods(self) -> dict[str, Method]:
        return {
            "Configure": Method(nri_pb2.ConfigureRequest, self.configure),
            "Synchronize": Method(nri_pb2.SynchronizeRequest, self.synchronize),
            "Shutdown": Method(nri_pb2.Empty, self.shutdown),
            "CreateContainer": Method(nri_pb2.CreateContainerRequest, self.create_container),
            "StateChange": Method(nri_pb2.StateChangeEvent, self.state_change),
        }

    async def _bounded(self, what: str, call: Awaitable[T]) -> T:
        """``call``, cut short before the runtime's request timeout would drop the plugin."""
        budget = max(self._request_timeout - ANSWER_MARGIN, self._request_timeout / 2)
        try:
            async with asyncio.timeout(budget):
                return await call
        except TimeoutError:
            raise Status(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"NRI plugin {self._name} did not answer {what} within {budget:.2f}s"
            ) from None

    async def configure(self, request: nri_pb2.ConfigureRequest) -> nri_pb2.ConfigureResponse:
        if request.request_timeout > 0:
            self._request_timeout = request.request_timeout / 1000
        try:
            events = frozenset(await self._bounded("Configure", self._handler.configure(request, self._runtime)))
        except Exception as exc:
            self.failure = f"the handler's configure failed: {exc}"
            raise
        unhandled = events - HANDLED_EVENTS
        if not events or unhandled:
            names = ", ".join(nri_pb2.Event.Name(e) if e in nri_pb2.Event.values() else str(e) for e in unhandled)
            self.failure = (
                f"the handler subscribed to {f'events it has no method for: {names}' if names else 'nothing'}"
            )
            raise Status(grpc.StatusCode.INVALID_ARGUMENT, self.failure)
        self.configured = True
        log.info(
            "NRI plugin %s configured by %s %s; subscribed to %s",
            self._name,
            request.runtime_name,
            request.runtime_version,
            ", ".join(sorted(nri_pb2.Event.Name(e) for e in events)),
        )
        return nri_pb2.ConfigureResponse(events=event_mask(events))

    async def synchronize(self, request: nri_pb2.SynchronizeRequest) -> nri_pb2.SynchronizeResponse:
        self._pods.extend(request.pods)
        self._containers.extend(request.containers)
        if request.more:
            return nri_pb2.SynchronizeResponse(more=True)
        pods, containers = self._pods, self._containers
        self._pods, self._containers = [], []
        updates = await self._bounded("Synchronize", self._handler.synchronize(pods, containers))
        return nri_pb2.SynchronizeResponse(update=updates)

    async def create_container(self, request: nri_pb2.CreateContainerRequest) -> nri_pb2.CreateContainerResponse:
        return await self._refusable("CreateContainer", request.container.name, self._handler.create_container(request))

    async def _refusable(self, what: str, container: str, call: Awaitable[T]) -> T:
        """A handler's answer to a call that may refuse the container: its refusal as FAILED_PRECONDITION,
        any other failure as INTERNAL."""
        try:
            return await self._bounded(what, call)
        except ContainerRefused as exc:
            raise Status(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        except Status:
            raise
        except Exception as exc:
            log.exception("NRI plugin %s: %s failed on %s", self._name, what, container)
            raise Status(grpc.StatusCode.INTERNAL, f"NRI plugin {self._name} failed: {exc!r}") from None

    async def state_change(self, event: nri_pb2.StateChangeEvent) -> nri_pb2.Empty:
        if event.event == nri_pb2.START_CONTAINER:
            starting = self._handler.start_container(event.pod, event.container)
            await self._refusable("StartContainer", event.container.name, starting)
            return nri_pb2.Empty()
        handle = {
            nri_pb2.STOP_POD_SANDBOX: self._handler.stop_pod_sandbox,
            nri_pb2.REMOVE_POD_SANDBOX: self._handler.remove_pod_sandbox,
        }.get(event.event)
        if handle is not None:
            await self._logged(nri_pb2.Event.Name(event.event), handle(event.pod))
        return nri_pb2.Empty()

    async def shutdown(self, _: nri_pb2.Empty) -> nri_pb2.Empty:
        await self._logged("Shutdown", self._handler.shutdown())
        return nri_pb2.Empty()

    async def _logged(self, what: str, call: Awaitable[None]) -> None:
        """Run a notification's handler; its failure is logged, not answered (see the module docstring)."""
        try:
            await self._bounded(what, call)
        except Exception:
            log.exception("NRI plugin %s: handling %s failed", self._name, what)


async def run_session(
    socket_path: Path,
    name: str,
    index: str,
    handler: PluginHandler,
    registration_timeout: float = DEFAULT_REGISTRATION_TIMEOUT,
) -> None:
    """Connect to the runtime's NRI socket, register as ``index``-``name`` and serve ``handler`` until
    the runtime closes the connection (returns) or the task is cancelled. Raises :class:`OSError` when
    the socket can't be reached, :class:`SessionRefused` when the runtime won't take the plugin, and
    :class:`gpushare.ttrpc.errors.TtrpcError` when the connection breaks or the protocol is broken."""
    check_index(index)
    reader, writer = await asyncio.open_unix_connection(str(socket_path))
    mux = Mux(reader, writer)
    client = Client(mux.open(RUNTIME_SERVICE_CONN))
    plugin = _PluginService(handler, _RuntimeLink(client), f"{index}-{name}")
    server = Server()
    server.register(PLUGIN_SERVICE, plugin.methods())
    carrier = asyncio.create_task(mux.run(), name=f"nri-mux-{index}-{name}")
    helpers = [asyncio.create_task(client.run()), asyncio.create_task(server.serve(mux.open(PLUGIN_SERVICE_CONN)))]
    try:
        try:
            await client.call(
                RUNTIME_SERVICE,
                "RegisterPlugin",
                nri_pb2.RegisterPluginRequest(plugin_name=name, plugin_idx=index),
                nri_pb2.Empty,
                timeout=registration_timeout,
            )
        except RemoteError as exc:
            raise SessionRefused(f"the runtime refused to register NRI plugin {index}-{name}: {exc.message}") from None
        log.info("NRI plugin %s-%s registered on %s", index, name, socket_path)
        await carrier
    finally:
        mux.close()
        for task in (carrier, *helpers):
            task.cancel()
        await asyncio.gather(carrier, *helpers, return_exceptions=True)
        if plugin.configured:  # whichever way it ended, the handler no longer enforces anything
            await plugin.shutdown(nri_pb2.Empty())
    if not plugin.configured:
        raise SessionRefused(
            f"the runtime closed the connection of NRI plugin {index}-{name} before configuring it"
            + (f": {plugin.failure}" if plugin.failure else "")
        )
    log.info("NRI plugin %s-%s: the runtime closed the connection", index, name)


async def run_forever(
    socket_path: Path, name: str, index: str, handler: PluginHandler, backoff: Backoff = RECONNECT_BACKOFF
) -> NoReturn:
    """:func:`run_session` again and again, until cancelled: after the runtime closed a session (containerd
    restarting), after the socket was missing or refused the connection, after a refusal. The waits grow
    along ``backoff`` and start over once a session was configured."""
    delays = backoff.delays()
    while True:
        try:
            await run_session(socket_path, name, index, handler)
            delays = backoff.delays()
            why = "the runtime closed the session"
        except (OSError, SessionRefused, TtrpcError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        delay = next(delays)
        log.warning("NRI plugin %s-%s: %s; connecting again in %.1fs", index, name, why, delay)
        await asyncio.sleep(delay)
