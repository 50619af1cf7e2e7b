"""The size of one ``aliyun.com/gpu-mem`` unit, and its spelling on the command line and in the inventory;
and the bounds on the numbers read from pods and nodes, checked where each is parsed.

A number read from a pod or a node goes on into integer sums and numpy's int64 arrays (the extender's
node matrix, the placement policies), where one too large raises OverflowError for every request that
meets it, or wraps around unnoticed. The API server accepts far larger quantities (``cpu: 1e30``), so
every parser of such a number checks it against the bound of its class here, and refuses a number
beyond it with a :class:`QuantityError` naming the object and field. The object alone is then refused
or flagged; nothing else is. The bounds leave room for sums: a node's figures add up thousands of pods'
before they reach an array.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from gpushare.contract.errors import ContractError, quoted

#: CPU in millicores, memory in bytes, a node's pod count: 2**53 (CPU: 9 * 10**12 cores; memory: 8 PiB),
#: which a float64 holds exactly, and which 1,024 of still sum within int64
HOST_LIMIT = 1 << 53
#: ``aliyun.com/gpu-mem`` units: a container's request, a node's total, what a card has or holds (in
#: an inventory, an allocation annotation or the ledger), and a card's MiB; 2**32 (4 PiB in MiB)
UNITS_LIMIT = 1 << 32
#: ``aliyun.com/gpu-count`` and everything else that counts or numbers cards: a node's cards, a card's
#: index, minor and NUMA node
CARDS_LIMIT = 1 << 16


class QuantityError(ContractError):
    """A number read from a pod or node that is negative, unreadable, or beyond the bound of its class."""


def bounded(number: int, limit: int, where: str, low: int = 0) -> int:
    """``number``, or QuantityError (naming ``where``) when it is less than ``low`` (negative, by default)
    or more than ``limit``."""
    if number < low:
        raise QuantityError(f"{where}: {quoted(number)} is " + ("negative" if low == 0 else f"less than {low}"))
    if number > limit:
        raise QuantityError(f"{where}: {quoted(number)} is more than the {limit} allowed")
    return number


def parse_host_quantity(value: Any, scale: int, unit: str, where: str) -> int:
    """A Kubernetes quantity (``500m``, ``2Gi``, ``1e3``) in ``unit`` (``scale`` of them to one: 1000
    millicores to a CPU), truncated, within :data:`HOST_LIMIT`; QuantityError naming ``where`` otherwise.
    The bound is checked before the whole number is made, so ``1e999999`` costs no more than ``1``."""
    try:
        amount = None if isinstance(value, bool) else parse_quantity(value) * scale
        finite = isinstance(amount, Decimal) and amount.is_finite()
    except (ValueError, TypeError, ArithmeticError):
        finite = False
    if not finite:
        raise QuantityError(f"{where}: {quoted(value)} is not a quantity")
    assert isinstance(amount, Decimal)
    if amount < 0:
        raise QuantityError(f"{where}: {quoted(value)} is negative")
    if amount > HOST_LIMIT:
        raise QuantityError(f"{where}: {quoted(value)} is more than the {HOST_LIMIT} {unit} allowed")
    return int(amount)


#: bytes in one MiB (what the API server's quantities and NVML's limits count in)
MIB_BYTES = 1 << 20
_UNIT_RE = re.compile(r"^(?:(GiB)|(MiB)|([1-9][0-9]*)MiB)$")


@dataclass(frozen=True, slots=True)
class MemoryUnit:
    """The size of one ``aliyun.com/gpu-mem`` unit."""

    mib: int

    @property
    def name(self) -> str:
        return format_unit(self)

    @property
    def bytes(self) -> int:
        return self.mib * MIB_BYTES

    def units_of(self, memory_mib: int) -> int:
        """Whole units in ``memory_mib`` (rounded down: a partial unit can't be handed out)."""
        return memory_mib // self.mib

    def describe(self, units: int) -> str:
        """Human wording such as ``12 GiB`` or ``3 x 512MiB``."""
        if self.mib == 1024:
            return f"{units} GiB"
        if self.mib == 1:
            return f"{units} MiB"
        return f"{units} x {self.mib}MiB"


GIB = MemoryUnit(1024)


def parse_unit(text: str) -> MemoryUnit:
    m = _UNIT_RE.match(text.strip())
    if not m:
        raise ContractError(f"memory unit {quoted(text)} is not one of GiB, MiB or <N>MiB")
    if m.group(1):
        return GIB
    if m.group(2):
        return MemoryUnit(1)
    return MemoryUnit(bounded(int(m.group(3)), UNITS_LIMIT, f"memory unit {quoted(text)}"))


def format_unit(unit: MemoryUnit) -> str:
    if unit.mib == 1024:
        return "GiB"
    if unit.mib == 1:
        return "MiB"
    return f"{unit.mib}MiB"
