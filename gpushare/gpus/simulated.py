"""Simulated cards, from a spec such as ``2xA100-80GB:81920,1xT4:15360`` (``--gpus sim:SPEC``): the
same cards for the same node in every process, their health driven by the caller."""

from __future__ import annotations

import logging
import re
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path

from gpushare.cards import Card
from gpushare.gpus.backend import DEFAULT_IGNORED_XIDS, CardBook, InventoryError, is_critical_xid
from gpushare.memlimits.enforcer import MemoryLimitError

log = logging.getLogger(__name__)

_SIM_NAMESPACE = uuidlib.UUID("6d0c9b0e-2f4a-4a53-9f5e-8f8f3b1f1a10")
_SIM_PART = re.compile(r"^([1-9][0-9]*)x([A-Za-z0-9._-]+):([1-9][0-9]*)$")
#: why a simulated card's memory is never limited
SIMULATED_LIMITS = "simulated card: no NVIDIA driver to enforce memory limits"


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
                memory_limits=SIMULATED_LIMITS,
            )
        )
    return cards


class SimulatedBackend(CardBook):
    """Cards from a spec string; health is driven by :meth:`inject_xid` and :meth:`recover`."""

    def __init__(self, node_name: str, spec: str, ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS):
        super().__init__(simulated_cards(node_name, spec))
        self._ignored = ignored_xids

    def close(self) -> None:
        """Nothing to release."""

    def set_memory_limit(self, uuid: str, cgroup: Path, soft_bytes: int, hard_bytes: int) -> None:
        raise MemoryLimitError(f"card {uuid}: {SIMULATED_LIMITS}")

    def inject_xid(self, uuid: str, xid: int) -> bool:
        """Report XID ``xid`` on a card. Returns whether it changed the card's health."""
        if not is_critical_xid(xid, self._ignored):
            log.info("card %s: XID %d ignored (application error)", uuid, xid)
            return False
        return self._set(uuid, False, f"XID {xid}")

    def recover(self, uuid: str) -> None:
        self._set(uuid, True, "recovered")
