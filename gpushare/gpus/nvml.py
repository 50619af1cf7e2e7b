"""The cards of a real node, read through NVML (``--gpus nvml``), and their health watched."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from itertools import combinations
from pathlib import Path
from typing import Any

from gpushare.cards import ENFORCED, Card
from gpushare.gpus.backend import (
    DEFAULT_IGNORED_XIDS,
    DEFAULT_NVML_RECOVERY,
    CardBook,
    InventoryError,
    is_critical_xid,
)
from gpushare.memlimits.cgroups import UNKNOWN_V1, CgroupLayout
from gpushare.memlimits.enforcer import MemoryLimitError

log = logging.getLogger(__name__)

#: NVML's memory-affinity bitmask is read in 64-bit words: 2 words cover 128 NUMA nodes
_NUMA_WORDS = 2


def _numa_of_bus(bus_id: str) -> int | None:
    # NVML reports an 8-digit domain; sysfs uses 4.
    short = bus_id.lower()[-12:] if len(bus_id) > 12 else bus_id.lower()
    path = Path("/sys/bus/pci/devices") / short / "numa_node"
    try:
        value = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


def _single_node(mask: Iterable[int]) -> int | None:
    """The NUMA node of an affinity bitmask (64 nodes per word), or None unless exactly one is set."""
    nodes = [w * 64 + b for w, word in enumerate(mask) for b in range(64) if word >> b & 1]
    return nodes[0] if len(nodes) == 1 else None


class NvmlCallFailed(Exception):
    """One NVML call failed; the message names the call and NVML's reason."""

    def __init__(self, call: str, error: Exception) -> None:
        super().__init__(f"{call} failed: {error}")
        self.error = error


class _LeftOut(Exception):
    """A card that gpushare does not advertise, and why."""


@dataclass(frozen=True, slots=True)
class _Found:
    card: Card
    handle: object


class NvmlBackend(CardBook):
    """Cards read through pynvml; their health watched on a background thread.

    Health: a card turns Unhealthy on a critical XID (any XID not in ``ignored_xids``), or when NVML
    stops answering for it (a card that fell off the bus answers NVML_ERROR_GPU_IS_LOST; every card is
    probed each ``poll_interval``). NVML has no "recovered" event, so such a card turns Healthy again
    once ``recovery_after`` seconds have passed since its last fault and NVML answers for it again. A
    card whose XID events can't be registered stays Unhealthy until the agent restarts, since nothing
    would report its faults.

    Memory limits: each card's :attr:`~gpushare.cards.Card.memory_limits` says whether the driver caps
    a cgroup's allocations on it (``nvmlDeviceSetMemoryLimits_v1``, driver 615+), probed at start with
    ``nvmlDeviceGetMemoryLimits_v1`` on the root of ``layout``'s cgroup v2 hierarchy: not on cgroup v1
    or hybrid nodes, nor with a driver (or binding) that lacks the call, nor where the driver answers
    with an error.

    Left out of the inventory, with one log line each: cards in MIG mode (their memory belongs to their
    MIG instances, which gpushare doesn't serve; leave MIG cards to NVIDIA's device plugin or turn MIG
    off), and cards NVML can't read at start-up (lost already). Indices stay NVML's.
    """

    def __init__(
        self,
        ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS,
        recovery_after: float = DEFAULT_NVML_RECOVERY,
        poll_interval: float = 1.0,
        layout: CgroupLayout = UNKNOWN_V1,
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
                f"NVML could not be initialised: nvmlInit failed: {exc}. On a GPU node, check the NVIDIA "
                "driver (nvidia-smi); elsewhere use --gpus sim:SPEC to simulate cards"
            ) from None
        try:
            found = [
                _Found(replace(f.card, memory_limits=self._limits_of(f, layout)), f.handle) for f in self._read_cards()
            ]
            super().__init__(f.card for f in found)
            self._handles = {f.card.uuid: f.handle for f in found}
            self._uuid_at = {_address(f.handle): f.card.uuid for f in found}
            self._ignored = ignored_xids
            self._recovery_after = recovery_after
            self._poll_interval = poll_interval
            #: when each card that can recover last failed (monotonic seconds)
            self._faults: dict[str, float] = {}
            self._events = self._register_events()
        except BaseException:
            pynvml.nvmlShutdown()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nvml-health", daemon=True)
        self._thread.start()

    # --- reading the cards ----------------------------------------------------------------------------

    def _ask(self, call: Callable[..., Any], *args: object) -> Any:
        try:
            return call(*args)
        except self._nvml.NVMLError as exc:
            raise NvmlCallFailed(call.__name__, exc) from None

    def _read_cards(self) -> list[_Found]:
        try:
            count = self._ask(self._nvml.nvmlDeviceGetCount)
        except NvmlCallFailed as exc:
            raise InventoryError(f"NVML can't list the cards: {exc}") from None
        found = []
        for index in range(count):
            try:
                found.append(self._read_card(index))
            except _LeftOut as exc:
                log.warning("%s; not advertised", exc)
        peers = self._nvlink_peers(found)
        return [_Found(replace(f.card, nvlink_peers=tuple(sorted(peers[f.card.uuid]))), f.handle) for f in found]

    def _read_card(self, index: int) -> _Found:
        nv, ask = self._nvml, self._ask
        who = f"card at NVML index {index}"
        try:
            handle = ask(nv.nvmlDeviceGetHandleByIndex, index)
            uuid = _text(ask(nv.nvmlDeviceGetUUID, handle))
            who = f"card {uuid} (NVML index {index})"
            if self._mig_enabled(handle):
                raise _LeftOut(
                    f"{who} is in MIG mode and gpushare shares whole cards only (turn MIG off with "
                    f"nvidia-smi -i {index} -mig 0, or serve the card with NVIDIA's device plugin)"
                )
            bus_id = _text(ask(nv.nvmlDeviceGetPciInfo, handle).busId)
            card = Card(
                index=index,
                uuid=uuid,
                model=_text(ask(nv.nvmlDeviceGetName, handle)),
                memory_mib=ask(nv.nvmlDeviceGetMemoryInfo, handle).total // (1024 * 1024),
                minor=ask(nv.nvmlDeviceGetMinorNumber, handle),
                numa_node=self._numa_node(handle, bus_id),
                reserved_mib=self._reserved_mib(handle, who),
            )
        except NvmlCallFailed as exc:
            raise _LeftOut(f"{who}: {exc}") from None
        log.info(
            "card %s (NVML index %d, minor %d, %s): %s, %d MiB, NUMA node %s",
            card.uuid, index, card.minor, bus_id, card.model, card.memory_mib, card.numa_node,
        )  # fmt: skip
        return _Found(card, handle)

    def _reserved_mib(self, handle: object, who: str) -> int:
        """What the driver keeps of the card for itself (``nvmlMemory_v2_t.reserved``, NVML's
        nvmlDeviceGetMemoryInfo_v2); 0 where the driver lacks the call (before r510), as the v1 answer
        counts it as used and can't tell it apart."""
        nv = self._nvml
        try:
            info = self._ask(nv.nvmlDeviceGetMemoryInfo, handle, nv.nvmlMemory_v2)
        except NvmlCallFailed as exc:
            log.warning("%s: reserved memory unknown, taken as 0: %s", who, exc)
            return 0
        return int(info.reserved) // (1024 * 1024)

    def _mig_enabled(self, handle: object) -> bool:
        nv = self._nvml
        try:
            current, _pending = self._ask(nv.nvmlDeviceGetMigMode, handle)
        except NvmlCallFailed as exc:
            if isinstance(exc.error, nv.NVMLError_NotSupported | nv.NVMLError_FunctionNotFound):
                return False  # a card (or driver) without MIG
            raise
        return current == nv.NVML_DEVICE_MIG_ENABLE

    def _numa_node(self, handle: object, bus_id: str) -> int | None:
        """NVML's memory affinity for the card; sysfs when the driver can't say."""
        nv = self._nvml
        try:
            mask = self._ask(nv.nvmlDeviceGetMemoryAffinity, handle, _NUMA_WORDS, nv.NVML_AFFINITY_SCOPE_NODE)
        except NvmlCallFailed as exc:
            if isinstance(exc.error, nv.NVMLError_NotSupported | nv.NVMLError_FunctionNotFound):
                return _numa_of_bus(bus_id)
            raise
        return _single_node(mask)

    def _nvlink_peers(self, found: list[_Found]) -> dict[str, set[str]]:
        """Pairs NVML reports as NVLink-connected: bridged directly or both on an NVSwitch fabric."""
        nv = self._nvml
        peers: dict[str, set[str]] = {f.card.uuid: set() for f in found}
        for a, b in combinations(found, 2):
            try:
                status = self._ask(nv.nvmlDeviceGetP2PStatus, a.handle, b.handle, nv.NVML_P2P_CAPS_INDEX_NVLINK)
            except NvmlCallFailed as exc:
                if not isinstance(exc.error, nv.NVMLError_NotSupported):  # NotSupported: no NVLink on a card
                    log.warning("cards %s and %s: %s; taken as not NVLink-connected", a.card.uuid, b.card.uuid, exc)
                continue
            if status == nv.NVML_P2P_STATUS_OK:
                peers[a.card.uuid].add(b.card.uuid)
                peers[b.card.uuid].add(a.card.uuid)
        return peers

    # --- memory limits ----------------------------------------------------------------------------------

    def _limits_of(self, found: _Found, layout: CgroupLayout) -> str:
        """Whether the driver enforces per-cgroup memory limits on the card (see the class docstring)."""
        nv, card = self._nvml, found.card
        why = layout.why_not or (None if hasattr(nv, "nvmlDeviceGetMemoryLimits_v1") else _OLD_BINDING)
        if why is None:
            limits = nv.c_nvmlGetMemoryLimits_v1_t()
            root = str(layout.unified).encode()
            limits.nameSpace = root
            try:
                self._ask(nv.nvmlDeviceGetMemoryLimits_v1, found.handle, limits)
            except NvmlCallFailed as exc:
                why = _OLD_DRIVER if isinstance(exc.error, nv.NVMLError_FunctionNotFound) else str(exc)
        status = ENFORCED if why is None else why
        log.info("card %s (NVML index %d): memory limits %s", card.uuid, card.index, status)
        return status

    def set_memory_limit(self, uuid: str, cgroup: Path, soft_bytes: int, hard_bytes: int) -> None:
        nv = self._nvml
        limits = nv.c_nvmlSetMemoryLimits_v1_t()
        name = str(cgroup).encode()
        limits.nameSpace, limits.softLimit, limits.hardLimit = name, soft_bytes, hard_bytes
        try:
            self._ask(nv.nvmlDeviceSetMemoryLimits_v1, self._handles[uuid], limits)
        except NvmlCallFailed as exc:
            raise MemoryLimitError(str(exc)) from None

    # --- health -----------------------------------------------------------------------------------------

    def _register_events(self) -> object:
        nv = self._nvml
        try:
            events = self._ask(nv.nvmlEventSetCreate)
        except NvmlCallFailed as exc:
            raise InventoryError(f"NVML can't watch card health: {exc}") from None
        for uuid, handle in self._handles.items():
            try:
                self._ask(nv.nvmlDeviceRegisterEvents, handle, nv.nvmlEventTypeXidCriticalError, events)
            except NvmlCallFailed as exc:
                # A card that can't report XIDs can't be trusted with work.
                self._set(uuid, False, f"{exc}: its XID events can't be watched")
        return events

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        nv = self._nvml
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlEventSetFree(self._events)
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlShutdown()

    def _watch(self) -> None:
        next_probe = time.monotonic()
        while not self._stop.is_set():
            self._wait_event()
            if time.monotonic() >= next_probe:
                self._probe()
                next_probe = time.monotonic() + self._poll_interval

    def _wait_event(self) -> None:
        nv = self._nvml
        try:
            event = nv.nvmlEventSetWait(self._events, max(1, int(self._poll_interval * 1000)))
        except nv.NVMLError_Timeout:
            return
        except nv.NVMLError as exc:
            # NVML doesn't say which card: probe them all now, and don't spin on an error that persists
            log.error("nvmlEventSetWait failed: %s; probing every card", exc)
            self._probe()
            self._stop.wait(self._poll_interval)
            return
        xid = int(event.eventData)
        uuid = self._uuid_at.get(_address(event.device))
        if uuid is None:
            log.warning("XID %d reported for a device that is not in the inventory; ignored", xid)
        elif is_critical_xid(xid, self._ignored):
            self._fault(uuid, f"XID {xid}")
        else:
            log.info("card %s: XID %d ignored (application error)", uuid, xid)

    def _fault(self, uuid: str, reason: str) -> None:
        self._faults[uuid] = time.monotonic()
        self._set(uuid, False, reason)

    def _probe(self) -> None:
        """Ask NVML about every card that is healthy, or unhealthy but due for its recovery check."""
        now = time.monotonic()
        for card in self.cards():
            failed_at = self._faults.get(card.uuid)
            if not card.healthy and (failed_at is None or now - failed_at < self._recovery_after):
                continue
            try:
                self._ask(self._nvml.nvmlDeviceGetMemoryInfo, self._handles[card.uuid])
            except NvmlCallFailed as exc:
                if card.healthy:
                    self._fault(card.uuid, str(exc))
                else:
                    self._faults[card.uuid] = now  # still failing: the wait starts again
                continue
            if not card.healthy:
                del self._faults[card.uuid]
                self._set(card.uuid, True, f"no fault for {self._recovery_after:g}s and NVML answers again")


_OLD_DRIVER = "the driver has no per-cgroup memory limits (nvmlDeviceSetMemoryLimits_v1 needs release 615 or later)"
_OLD_BINDING = "the NVML binding predates per-cgroup memory limits (nvidia-ml-py 13.615 or later has them)"


def _address(handle: object) -> int | None:
    """An NVML device handle's pointer value: event data carries the same pointer as the handle."""
    import ctypes

    return ctypes.cast(handle, ctypes.c_void_p).value


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
