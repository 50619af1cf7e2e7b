"""Setting a pod's GPU memory limits on its cgroup (:mod:`~gpushare.memlimits.policy` says which), on the
cards whose driver enforces them. The CRI shim calls it before each GPU container of the pod is
created, and again for every running pod when it starts; a limit it can't set refuses the container."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpushare.cards import Card
from gpushare.contract.units import MIB_BYTES, MemoryUnit
from gpushare.memlimits.cgroups import CgroupLayout, cgroup_dir
from gpushare.memlimits.policy import Limit, pod_limits

log = logging.getLogger(__name__)


class MemoryLimitError(RuntimeError):
    """The driver did not set a cgroup's memory limit on a card; the message is its answer."""


#: NVML's ``NVML_DEVICE_MEMORY_LIMIT_MAX``: with soft 0, no limit (nvmlSetMemoryLimits_v1_t)
NO_HARD_LIMIT = 0xFFFFFFFFFFFFFFFF
#: (card UUID, cgroup directory, soft bytes, hard bytes); raises MemoryLimitError
SetLimit = Callable[[str, Path, int, int], None]


@dataclass(frozen=True, slots=True)
class PodLimiter:
    set_limit: SetLimit
    layout: CgroupLayout
    unit: MemoryUnit
    #: held while limits are set or cleared; the start-up sweep holds it across its look at the runtime,
    #: so that it can't clear what a container created meanwhile was just given
    lock: threading.RLock = field(default_factory=threading.RLock, compare=False, repr=False)

    def apply(self, who: str, cgroup_parent: str, held: Mapping[str, int], cards: Sequence[Card]) -> str | None:
        """Set the limits of the pod ``who`` (``pod NS/NAME container C``), whose cgroup kubelet named
        ``cgroup_parent`` and which holds ``held`` units per card UUID: None when every card that
        enforces limits has its limit, else why not (a refusal naming the pod, card and cause). Cards
        whose driver doesn't enforce limits are left alone: the node's inventory says so."""
        by_uuid = {c.uuid: c for c in cards}
        limits = [limit for limit in pod_limits(held, cards, self.unit) if by_uuid[limit.uuid].limits_enforced]
        if not limits:
            return None
        if self.layout.unified is None or not cgroup_parent:
            where = (
                "the node has no cgroup v2 hierarchy"
                if self.layout.unified is None
                else ("kubelet gives the pod no cgroup of its own (cgroupsPerQOS is off)")
            )
            return f"{who}: {_card(limits[0])} enforces memory limits, but {where}, so the pod's share can't be held"
        try:
            directory = cgroup_dir(self.layout.unified, cgroup_parent)
        except ValueError as exc:
            return f"{who}: the pod's cgroup can't be found: {exc}"
        with self.lock:
            for limit in limits:
                try:
                    self.set_limit(limit.uuid, directory, limit.soft_bytes, limit.hard_bytes)
                except MemoryLimitError as exc:
                    why = f"the driver did not set the pod's memory limit on cgroup {directory}: {exc}"
                    return f"{who}: {_card(limit)}: {why}"
                log.info(
                    "%s: %s limited to %d MiB in cgroup %s", who, _card(limit), limit.hard_bytes // MIB_BYTES, directory
                )
        return None

    def clear(self, who: str, cgroup_parent: str, cards: Sequence[Card]) -> list[str]:
        """Take the limits off the cgroup of the pod ``who`` on every card that enforces limits (soft 0,
        hard :data:`NO_HARD_LIMIT`: NVML's "no limit"), so that no soft limit, the driver's guarantee,
        outlives the pod's processes; a card without one is left as it was. Called once the pod's
        sandbox is stopped. Returns what failed, one line per card naming pod, card and cause (each
        also logged); never raises."""
        enforcing = [card for card in cards if card.limits_enforced]
        if not enforcing or self.layout.unified is None or not cgroup_parent:
            return []
        try:
            directory = cgroup_dir(self.layout.unified, cgroup_parent)
        except ValueError as exc:
            return [_failed(f"{who}: the pod's cgroup can't be found: {exc}")]
        if not directory.is_dir():
            return []  # the cgroup is gone, and the driver dropped its limits with it
        failures = []
        with self.lock:
            for card in enforcing:
                try:
                    self.set_limit(card.uuid, directory, 0, NO_HARD_LIMIT)
                except MemoryLimitError as exc:
                    where = f"card {card.index} ({card.uuid})"
                    failures.append(_failed(f"{who}: {where}: limits not cleared on cgroup {directory}: {exc}"))
        if not failures:
            log.info("%s: memory limits cleared on cgroup %s", who, directory)
        return failures


def _failed(why: str) -> str:
    log.error("%s", why)
    return why


def _card(limit: Limit) -> str:
    return f"card {limit.index} ({limit.uuid})"
