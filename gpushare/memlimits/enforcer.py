"""Setting a pod's GPU memory limits on its cgroup and its GPU containers' cgroups
(:mod:`~gpushare.memlimits.policy` says which), on the cards whose driver enforces them, and taking them
off again. The node agent sets the pod's before each of its GPU containers is created and a container's
before its process starts, and both again for what runs when the agent starts; a limit it can't set
refuses the container."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpushare.cards import Card
from gpushare.contract.units import MIB_BYTES, MemoryUnit
from gpushare.memlimits.cgroups import CgroupLayout, cgroup_dir, kubepods_root, pod_cgroups
from gpushare.memlimits.policy import Limit, container_limits, pod_limits

log = logging.getLogger(__name__)


class MemoryLimitError(RuntimeError):
    """The driver did not set a cgroup's memory limit on a card; the message is its answer."""


#: NVML's ``NVML_DEVICE_MEMORY_LIMIT_MAX``: with soft 0, no limit (nvmlSetMemoryLimits_v1_t)
NO_HARD_LIMIT = 0xFFFFFFFFFFFFFFFF
#: kubelet's pod hierarchy under its default ``cgroupRoot`` (/), for the cgroupfs and systemd drivers
KUBELET_ROOTS = ("kubepods", "kubepods.slice")
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
        return self._set(who, "the pod", cgroup_parent, pod_limits(held, cards, self.unit), cards, make=False)

    def apply_container(
        self, who: str, cgroups_path: str, held: Mapping[str, int], cards: Sequence[Card], make: bool = False
    ) -> str | None:
        """Set the limits of the container ``who`` given ``held`` units per card UUID, on the cgroup its
        runtime spec names (``linux.cgroupsPath``), before its process starts; as :meth:`apply`.
        ``make``: create the cgroup's directory first when it isn't there yet (the runtime makes it
        only as it starts the container, and uses one that exists)."""
        return self._set(who, "the container", cgroups_path, container_limits(held, cards, self.unit), cards, make)

    def _set(
        self, who: str, owner: str, cgroup: str, limits: Sequence[Limit], cards: Sequence[Card], make: bool
    ) -> str | None:
        """Set ``limits`` on the cgroup of ``owner`` (the pod, the container) named ``cgroup``."""
        whose = f"{owner}'s"
        by_uuid = {c.uuid: c for c in cards}
        limits = [limit for limit in limits if by_uuid[limit.uuid].limits_enforced]
        if not limits:
            return None
        if self.layout.unified is None or not cgroup:
            where = "the node has no cgroup v2 hierarchy" if self.layout.unified is None else _NO_CGROUP[owner]
            return f"{who}: {_card(limits[0])} enforces memory limits, but {where}, so its share can't be held"
        try:
            directory = cgroup_dir(self.layout.unified, cgroup)
        except ValueError as exc:
            return f"{who}: {whose} cgroup can't be found: {exc}"
        with self.lock:
            if make:
                try:
                    _delegate_dmem(directory.parent)
                    directory.mkdir(exist_ok=True)
                except OSError as exc:
                    return f"{who}: {whose} cgroup {directory} can't be made: {exc}"
            for limit in limits:
                try:
                    self.set_limit(limit.uuid, directory, limit.soft_bytes, limit.hard_bytes)
                except MemoryLimitError as exc:
                    why = f"the driver did not set {whose} memory limit on cgroup {directory}: {exc}"
                    return f"{who}: {_card(limit)}: {why}"
                log.info(
                    "%s: %s limited to %d MiB (%d MiB guaranteed) in cgroup %s",
                    who, _card(limit), limit.hard_bytes // MIB_BYTES, limit.soft_bytes // MIB_BYTES, directory,
                )  # fmt: skip
        return None

    def clear(self, who: str, cgroup_parent: str, cards: Sequence[Card]) -> list[str]:
        """Take the limits off the cgroup of the pod ``who``, and off each of its child cgroups still
        there (its containers'), deepest first, on every card that enforces limits (soft 0, hard
        :data:`NO_HARD_LIMIT`: NVML's "no limit"), so that no soft limit, the driver's guarantee and a
        reservation on the cgroup's ancestors, outlives the pod's processes (NVIDIA's advice: soft back
        to 0 before the cgroup is removed, or the ancestors' reservations drift). Called once the pod's
        sandbox is stopped, and for pods found ended at start. Returns what failed, one line per cgroup
        and card naming pod, card and cause (each also logged); never raises."""
        enforcing = [card for card in cards if card.limits_enforced]
        if not enforcing or self.layout.unified is None or not cgroup_parent:
            return []
        try:
            directory = cgroup_dir(self.layout.unified, cgroup_parent)
        except ValueError as exc:
            return [_failed(f"{who}: the pod's cgroup can't be found: {exc}")]
        return self._clear_tree(who, directory, enforcing)

    def _clear_tree(self, who: str, directory: Path, enforcing: Sequence[Card]) -> list[str]:
        failures = []
        with self.lock:
            for cgroup in _deepest_first(directory):
                failed_before = len(failures)
                for card in enforcing:
                    try:
                        self.set_limit(card.uuid, cgroup, 0, NO_HARD_LIMIT)
                    except MemoryLimitError as exc:
                        if cgroup.is_dir():  # a container's cgroup that went meanwhile took its limits along
                            where = f"card {card.index} ({card.uuid})"
                            failures.append(_failed(f"{who}: {where}: limits not cleared on cgroup {cgroup}: {exc}"))
                if len(failures) == failed_before:
                    log.info("%s: memory limits cleared on cgroup %s", who, cgroup)
        return failures

    def sweep(self, cgroup_parents: Iterable[str], running: Collection[str], cards: Sequence[Card]) -> list[str]:
        """Clear the limits of every pod cgroup under kubelet's default roots (:data:`KUBELET_ROOTS`) or
        beside those the runtime's sandboxes name (``cgroup_parents``: kubelet's pod cgroups, under its QoS
        classes) whose pod UID is not among
        ``running`` (the pods with a ready sandbox) and in which no process runs: pods that ended while
        the node agent was away, whose cgroups kubelet has not removed yet. NVML lists no cgroups with
        limits, so they are found by walking kubelet's hierarchy. A pod started since the runtime was
        asked always has a process there (its sandbox's) before its first container gets limits, so
        its limits are never taken. Returns the UIDs of the pods cleared."""
        enforcing = [card for card in cards if card.limits_enforced]
        if not enforcing or self.layout.unified is None:
            return []
        # kubelet's default roots too: the runtime lists no sandbox when the pod that ended was the last
        roots = {self.layout.unified / name for name in KUBELET_ROOTS}
        for parent in cgroup_parents:
            try:
                roots.add(kubepods_root(cgroup_dir(self.layout.unified, parent)))
            except ValueError:
                continue
        cleared = []
        for uid, directory in sorted(pod_cgroups(roots).items()):
            if uid not in running and not _populated(directory):
                self._clear_tree(f"pod uid {uid} (no ready sandbox)", directory, enforcing)
                cleared.append(uid)
        return cleared


def _populated(cgroup: Path) -> bool:
    """Whether a process runs in ``cgroup`` or below it (``populated 1`` in its ``cgroup.events``, the
    kernel's cgroup-v2.rst); a directory without that file is no cgroup and holds none."""
    try:
        events = (cgroup / "cgroup.events").read_text().split("\n")
    except OSError:
        return False
    return "populated 1" in events


def _delegate_dmem(parent: Path) -> None:
    """Turn the kernel's ``dmem`` controller on for ``parent``'s children where ``parent`` has it, as runc
    does for every controller when it makes a container's cgroup (opencontainers/cgroups,
    ``fs2/create.go``, CreateCgroupPath: ``+controller`` into each parent's ``cgroup.subtree_control``):
    a cgroup made before runc runs would otherwise have no ``dmem.max`` when the driver's limit is set
    (the kernel's cgroup-v2.rst, "Enabling and Disabling")."""
    try:
        available = (parent / "cgroup.controllers").read_text().split()
        enabled = (parent / "cgroup.subtree_control").read_text().split()
    except OSError:
        return  # no cgroup2 files (not a cgroup): nothing to delegate
    if "dmem" in available and "dmem" not in enabled:
        (parent / "cgroup.subtree_control").write_text("+dmem")


#: why an owner's cgroup is not named
_NO_CGROUP = {
    "the pod": "kubelet gives the pod no cgroup of its own (cgroupsPerQOS is off)",
    "the container": "the runtime names no cgroup for the container",
}


def _deepest_first(directory: Path) -> list[Path]:
    """``directory`` and the cgroups below it that exist, children before their parents; none when
    ``directory`` is gone (the driver dropped its limits with it)."""
    found: list[Path] = []
    try:
        children = [entry for entry in os.scandir(directory) if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return found
    for child in children:
        found.extend(_deepest_first(Path(child.path)))
    found.append(directory)
    return found


def _failed(why: str) -> str:
    log.error("%s", why)
    return why


def _card(limit: Limit) -> str:
    return f"card {limit.index} ({limit.uuid})"
