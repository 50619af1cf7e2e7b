"""Where the node's cards come from: NVML on a real node, a simulated backend everywhere else.

Both backends expose the same small interface: ``cards()`` for the current list (health included)
and ``subscribe()`` for health changes. Health changes come from XID events; which XIDs count as a
fault is decided by :func:`is_critical_xid` so both backends agree.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpushare.cards import Card

log = logging.getLogger(__name__)

#: XIDs that are the application's fault, not the card's (the same set NVIDIA's own plugin ignores).
DEFAULT_IGNORED_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})

_SIM_NAMESPACE = uuidlib.UUID("6d0c9b0e-2f4a-4a53-9f5e-8f8f3b1f1a10")
_SIM_PART = re.compile(r"^([1-9][0-9]*)x([A-Za-z0-9._-]+):([1-9][0-9]*)$")


class InventoryError(RuntimeError):
    """The card inventory can't be read. The message is one sentence meant for the operator."""


@dataclass(frozen=True, slots=True)
class HealthEvent:
    uuid: str
    healthy: bool
    reason: str


HealthCallback = Callable[[HealthEvent], None]


class GpuBackend(Protocol):
    def cards(self) -> list[Card]: ...

    def subscribe(self, callback: HealthCallback) -> None: ...

    def unsubscribe(self, callback: HealthCallback) -> None: ...

    def close(self) -> None: ...


def is_critical_xid(xid: int, ignored: frozenset[int]) -> bool:
    return xid not in ignored


def parse_ignored_xids(text: str) -> frozenset[int]:
    """``"13,31,43"`` -> the set; an empty string ignores nothing."""
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise InventoryError(f"--ignore-xids {text!r} is not a comma-separated list of integers") from None


class _Subscribers:
    def __init__(self) -> None:
        self._callbacks: list[HealthCallback] = []
        self._lock = threading.Lock()

    def add(self, callback: HealthCallback) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def remove(self, callback: HealthCallback) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def emit(self, event: HealthEvent) -> None:
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback(event)
            except Exception:
                log.exception("health subscriber failed on card %s", event.uuid)


class _CardBook:
    """The cards and their health, shared by both backends; health changes go to the subscribers."""

    def __init__(self, cards: Iterable[Card]) -> None:
        self._cards = {c.uuid: c for c in cards}
        self._subscribers = _Subscribers()
        self._lock = threading.Lock()

    def cards(self) -> list[Card]:
        with self._lock:
            return sorted(self._cards.values(), key=lambda c: c.index)

    def subscribe(self, callback: HealthCallback) -> None:
        self._subscribers.add(callback)

    def unsubscribe(self, callback: HealthCallback) -> None:
        """A stopped component hears of no more changes (a restarted one subscribes afresh)."""
        self._subscribers.remove(callback)

    def _set(self, uuid: str, healthy: bool, reason: str) -> bool:
        """Record a card's health; returns whether it changed (subscribers hear only of changes)."""
        with self._lock:
            card = self._cards.get(uuid)
            if card is None:
                raise InventoryError(f"card {uuid} is not on this node")
            if card.healthy == healthy:
                return False
            self._cards[uuid] = card.with_health(healthy)
        log.warning("card %s (index %d) is now %s: %s", uuid, card.index, _word(healthy), reason)
        self._subscribers.emit(HealthEvent(uuid, healthy, reason))
        return True


# --- simulated cards ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SimGroup:
    count: int
    model: str
    memory_mib: int


def parse_sim_spec(spec: str) -> tuple[SimGroup, ...]:
    """``2xA100-80GB:81920,1xT4:15360`` -> groups of identical cards, in order."""
    groups = []
    for part in spec.split(","):
        m = _SIM_PART.match(part.strip())
        if not m:
            raise InventoryError(
                f"simulated GPU spec part {part.strip()!r} is not COUNTxMODEL:MiB (e.g. 2xA100-80GB:81920)"
            )
        groups.append(SimGroup(int(m.group(1)), m.group(2), int(m.group(3))))
    return tuple(groups)


def simulated_cards(node_name: str, spec: str) -> list[Card]:
    """Deterministic cards for ``node_name``: the same flags give the same UUIDs in every process.

    The first half of the cards sits on NUMA node 0, the rest on NUMA node 1; cards of one model on one
    NUMA node are NVLink peers. Minor numbers run in reverse of the NVML index, as they can on real
    machines, so code that mixes the two up is caught.
    """
    flat = [(g.model, g.memory_mib) for g in parse_sim_spec(spec) for _ in range(g.count)]
    total = len(flat)
    uuids = [f"GPU-{uuidlib.uuid5(_SIM_NAMESPACE, f'{node_name}/{spec}/{i}')}" for i in range(total)]
    numa = [0 if i < (total + 1) // 2 else 1 for i in range(total)]
    cards = []
    for i, (model, mib) in enumerate(flat):
        peers = tuple(uuids[j] for j in range(total) if j != i and flat[j][0] == model and numa[j] == numa[i])
        cards.append(
            Card(
                index=i,
                uuid=uuids[i],
                model=model,
                memory_mib=mib,
                minor=total - 1 - i,
                numa_node=numa[i],
                nvlink_peers=peers,
            )
        )
    return cards


class SimulatedBackend(_CardBook):
    """Cards from a spec string; health is driven by :meth:`inject_xid` and :meth:`recover`."""

    def __init__(self, node_name: str, spec: str, ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS):
        super().__init__(simulated_cards(node_name, spec))
        self._ignored = ignored_xids

    def close(self) -> None:
        """Nothing to release."""

    def inject_xid(self, uuid: str, xid: int) -> bool:
        """Report XID ``xid`` on a card. Returns whether it changed the card's health."""
        if not is_critical_xid(xid, self._ignored):
            log.info("card %s: XID %d ignored (application error)", uuid, xid)
            return False
        return self._set(uuid, False, f"XID {xid}")

    def recover(self, uuid: str) -> None:
        self._set(uuid, True, "recovered")


def _word(healthy: bool) -> str:
    return "Healthy" if healthy else "Unhealthy"


# --- NVML ---------------------------------------------------------------------------------------------------


def _numa_of_bus(bus_id: str) -> int | None:
    # NVML reports an 8-digit domain; sysfs uses 4.
    short = bus_id.lower()[-12:] if len(bus_id) > 12 else bus_id.lower()
    path = Path("/sys/bus/pci/devices") / short / "numa_node"
    try:
        value = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


class NvmlBackend(_CardBook):
    """Cards read through pynvml; XID events watched on a background thread.

    NVML has no "recovered" event. A card that raised a critical XID is probed after ``recovery_after``
    seconds without a further XID, and marked healthy again if NVML answers for it.
    """

    def __init__(
        self,
        ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS,
        recovery_after: float = 300.0,
    ) -> None:
        try:
            import pynvml
        except ImportError:
            raise InventoryError(
                "the NVML Python binding (nvidia-ml-py) is not installed; use --gpus sim:SPEC to simulate cards"
            ) from None
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise InventoryError(
                f"NVML could not be initialised ({exc}): this node has no NVIDIA driver or GPU; "
                "use --gpus sim:SPEC to simulate cards"
            ) from None
        super().__init__(self._read_cards())
        self._ignored = ignored_xids
        self._recovery_after = recovery_after
        self._last_xid: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nvml-health", daemon=True)
        self._thread.start()

    def _read_cards(self) -> list[Card]:
        nv = self._nvml
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        bus_ids = [_text(nv.nvmlDeviceGetPciInfo(h).busId) for h in handles]
        uuids = [_text(nv.nvmlDeviceGetUUID(h)) for h in handles]
        uuid_of_bus = {b.lower(): u for b, u in zip(bus_ids, uuids, strict=True)}
        cards = []
        for i, h in enumerate(handles):
            cards.append(
                Card(
                    index=i,
                    uuid=uuids[i],
                    model=_text(nv.nvmlDeviceGetName(h)),
                    memory_mib=nv.nvmlDeviceGetMemoryInfo(h).total // (1024 * 1024),
                    minor=nv.nvmlDeviceGetMinorNumber(h),
                    numa_node=_numa_of_bus(bus_ids[i]),
                    nvlink_peers=tuple(sorted(self._nvlink_peers(h, uuid_of_bus) - {uuids[i]})),
                )
            )
        return cards

    def _nvlink_peers(self, handle: object, uuid_of_bus: dict[str, str]) -> set[str]:
        nv = self._nvml
        peers: set[str] = set()
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                if nv.nvmlDeviceGetNvLinkState(handle, link) != nv.NVML_FEATURE_ENABLED:
                    continue
                remote = _text(nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId).lower()
            except nv.NVMLError:
                break  # no NVLink on this card, or no more links
            if remote in uuid_of_bus:
                peers.add(uuid_of_bus[remote])
        return peers

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        nv = self._nvml
        event_set = nv.nvmlEventSetCreate()
        for card in self.cards():
            handle = nv.nvmlDeviceGetHandleByUUID(card.uuid)
            try:
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, event_set)
            except nv.NVMLError as exc:
                # A card that can't report XIDs can't be trusted with work.
                self._set(card.uuid, False, f"XID events unsupported ({exc})")
        while not self._stop.is_set():
            try:
                event = nv.nvmlEventSetWait(event_set, 1000)
            except nv.NVMLError_Timeout:
                self._probe_recoveries()
                continue
            except nv.NVMLError as exc:
                log.error("NVML event wait failed: %s", exc)
                self._stop.wait(1.0)
                continue
            xid = int(event.eventData)
            uuid = _text(nv.nvmlDeviceGetUUID(event.device))
            if is_critical_xid(xid, self._ignored):
                self._last_xid[uuid] = time.monotonic()
                self._set(uuid, False, f"XID {xid}")
            else:
                log.info("card %s: XID %d ignored (application error)", uuid, xid)
        nv.nvmlEventSetFree(event_set)

    def _probe_recoveries(self) -> None:
        now = time.monotonic()
        for uuid, at in list(self._last_xid.items()):
            if now - at < self._recovery_after:
                continue
            try:
                self._nvml.nvmlDeviceGetMemoryInfo(self._nvml.nvmlDeviceGetHandleByUUID(uuid))
            except self._nvml.NVMLError:
                self._last_xid[uuid] = now
                continue
            del self._last_xid[uuid]
            self._set(uuid, True, f"no critical XID for {self._recovery_after:.0f}s and NVML answers")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def open_backend(gpus: str, node_name: str, ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS) -> GpuBackend:
    """``--gpus nvml`` or ``--gpus sim:SPEC``."""
    if gpus == "nvml":
        return NvmlBackend(ignored_xids)
    if gpus.startswith("sim:"):
        return SimulatedBackend(node_name, gpus[4:], ignored_xids)
    raise InventoryError(f"--gpus {gpus!r} is neither 'nvml' nor 'sim:SPEC'")


def by_uuid(cards: Iterable[Card]) -> dict[str, Card]:
    return {c.uuid: c for c in cards}
