"""The size of one ``aliyun.com/gpu-mem`` unit, and its spelling on the command line and in the inventory."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpushare.contract.errors import ContractError, quoted

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
    return MemoryUnit(int(m.group(3)))


def format_unit(unit: MemoryUnit) -> str:
    if unit.mib == 1024:
        return "GiB"
    if unit.mib == 1:
        return "MiB"
    return f"{unit.mib}MiB"
