"""Setting a pod's GPU memory limits on its cgroup (:mod:`~gpushare.memlimits.policy` says which), on the
cards whose driver enforces them. The CRI shim calls it before each GPU container of the pod is
created, and again for every running pod when it starts; a limit it can't set refuses the container."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpushare.cards import Card
from gpushare.contract.units import MIB_BYTES, MemoryUnit
from gpushare.memlimits.cgroups import CgroupLayout, cgroup_dir
from gpushare.memlimits.policy import Limit, pod_limits

log = logging.getLogger(__name__)


class MemoryLimitError(RuntimeError):
    """The driver did not set a cgroup's memory limit on a card; the message is its answer."""


#: (card UUID, cgroup directory, soft bytes, hard bytes); raises MemoryLimitError
SetLimit = Callable[[str, Path, int, int], None]


@dataclass(frozen=True, slots=True)
class PodLimiter:
    set_limit: SetLimit
    layout: CgroupLayout
    unit: MemoryUnit

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
        for limit in limits:
            try:
                self.set_limit(limit.uuid, directory, limit.soft_bytes, limit.hard_bytes)
            except MemoryLimitError as exc:
                return (
                    f"{who}: {_card(limit)}: the driver did not set the pod's memory limit on cgroup {directory}: {exc}"
                )
            log.info(
                "%s: %s limited to %d MiB in cgroup %s", who, _card(limit), limit.hard_bytes // MIB_BYTES, directory
            )
        return None


def _card(limit: Limit) -> str:
    return f"card {limit.index} ({limit.uuid})"
