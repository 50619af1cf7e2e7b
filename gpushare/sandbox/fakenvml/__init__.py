"""A fake ``libnvidia-ml.so.1`` so that ``--gpus nvml`` runs, through the real pynvml binding, on a
machine without NVIDIA hardware: built from ``fakenvml.c`` with gcc, it presents the cards of a machine
description from ``machines/`` and takes scripted faults (XIDs, a card falling off the bus).

It keeps the per-container memory limits of NVML's ``nvmlDeviceSetMemoryLimits_v1`` (driver 615+) per card
and cgroup directory, dropping those whose directory is gone, and records the live ones in a file that
:meth:`FakeNvml.limits` reads. As NVIDIA documents for MPS v3 memory partitioning
(https://docs.nvidia.com/deploy/mps/latest/mpsv3-memory-partitioning.html), a soft limit is also reserved on
the cgroup's ancestors (:meth:`FakeNvml.held`), and stays there when the cgroup goes before its soft limit is
cleared; ``nvmlDeviceGetMemoryInfo(_v2)`` reports the hard cap to a process in a limited cgroup (hierarchical
under the ``dmem`` backend, the cgroup's own under ``misc``) and the card less what the driver reserves
(``reserved-mib``) to any other. A machine whose description says ``memory-limits absent`` gets a variant of
the library without the limit calls, as an older driver has, so that pynvml raises NVMLError_FunctionNotFound.

A process finds it first when ``LD_LIBRARY_PATH`` starts with :attr:`FakeNvml.library_dir`;
:meth:`FakeNvml.env` gives that and the three variables the library reads at ``nvmlInit``.
:func:`build_with_machine` gives a library with one machine's description compiled in, which it presents
when ``GPUSHARE_FAKE_NVML_MACHINE`` is unset: for a process that has only the library file, as a pod that
mounts the host's ``libnvidia-ml.so.1`` does. Faults still come only through the control file, and limits
are recorded only where ``GPUSHARE_FAKE_NVML_LIMITS`` says.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("fakenvml.c")
MACHINES = Path(__file__).with_name("machines")
LIBRARY = "libnvidia-ml.so.1"
#: the machine description the library reads at nvmlInit
ENV_MACHINE = "GPUSHARE_FAKE_NVML_MACHINE"
#: the file whose appended lines script faults (see fakenvml.c)
ENV_CONTROL = "GPUSHARE_FAKE_NVML_CONTROL"
#: the file the library rewrites with the live memory limits, one ``<uuid> <soft> <hard> <held> <cgroup path>`` a
#: line: the cgroup's own limits and what it holds for its descendants' soft limits, in bytes (see fakenvml.c)
ENV_LIMITS = "GPUSHARE_FAKE_NVML_LIMITS"
#: NVML_DEVICE_MEMORY_LIMIT_MAX: no hard limit
NO_HARD_LIMIT = 0xFFFFFFFFFFFFFFFF
#: defined for a library without the memory-limit calls (a driver older than 615)
NO_MEMORY_LIMITS = "-DFAKE_NVML_NO_MEMORY_LIMITS"
_CFLAGS = ("-shared", "-fPIC", "-O2", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror")


class FakeNvmlError(RuntimeError):
    """The fake library can't be built, or the machine asked for doesn't exist."""


def gcc_missing() -> str | None:
    """None when the library can be built here, else why not (a reason to skip)."""
    return None if shutil.which("gcc") else "gcc is not installed (apt-get install -y gcc)"


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpushare" / "fakenvml"


def c_string(data: bytes) -> str:
    """``data`` as C string literals, one a line of it, joined by line continuations so that a
    ``#define`` can hold them. Every byte but printable ASCII (and ``?``, which could start a trigraph) is an
    octal escape."""
    plain = set(range(0x20, 0x7F)) - {ord('"'), ord("\\"), ord("?")}
    lines = data.splitlines(keepends=True) or [b""]
    return " \\\n".join('"' + "".join(chr(b) if b in plain else f"\\{b:03o}" for b in line) + '"' for line in lines)


def machine_header(machine: Path) -> str:
    """The header that builds ``machine``'s description into the library (see fakenvml.c)."""
    return (
        f"#define FAKE_NVML_MACHINE_NAME {c_string(machine.name.encode())}\n"
        f"#define FAKE_NVML_MACHINE \\\n{c_string(machine.read_bytes())}\n"
    )


def has_memory_limits(machine: Path) -> bool:
    """False when the description says ``memory-limits absent`` (a driver without the memory-limit calls)."""
    lines = (raw.split("#", 1)[0].split() for raw in machine.read_text().splitlines())
    return ["memory-limits", "absent"] not in lines


def build(cache: Path | None = None, machine: Path | None = None, *, memory_limits: bool = True) -> Path:
    """The directory holding ``libnvidia-ml.so.1``, with ``machine``'s description built in when one is given,
    and without the memory-limit calls unless ``memory_limits``; compiled once per source, flags and description
    (one gcc call)."""
    header = machine_header(machine) if machine is not None else ""
    flags = (*_CFLAGS, *(() if memory_limits else (NO_MEMORY_LIMITS,)))
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode() + header.encode()).hexdigest()[:16]
    directory = (cache or _cache_root()) / digest
    library = directory / LIBRARY
    if library.is_file():
        return directory
    reason = gcc_missing()
    if reason:
        raise FakeNvmlError(f"can't build the fake {LIBRARY}: {reason}")
    directory.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent builders never see a half-written library
    with tempfile.TemporaryDirectory(prefix=f".{LIBRARY}.", dir=directory) as work:
        partial = Path(work) / LIBRARY
        include: list[str] = []
        if header:
            (Path(work) / "machine.h").write_text(header)
            include = ["-include", str(Path(work) / "machine.h")]
        command = ["gcc", *flags, *include, f"-Wl,-soname,{LIBRARY}", "-o", str(partial), str(SOURCE), "-lpthread"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise FakeNvmlError(f"gcc failed to build the fake {LIBRARY}:\n{done.stderr.strip()}")
        partial.chmod(0o755)
        os.replace(partial, library)
    return directory


def build_with_machine(machine: str, cache: Path | None = None) -> Path:
    """The path of a ``libnvidia-ml.so.1`` with ``machine`` (a shipped machine's name or a description file)
    built in, so that it needs no environment to present that machine."""
    description = machine_file(machine)
    return build(cache, description, memory_limits=has_memory_limits(description)) / LIBRARY


def machines() -> list[str]:
    return sorted(p.stem for p in MACHINES.glob("*.txt"))


def machine_file(name: str) -> Path:
    """A shipped machine by name (``dgx-a100``) or a description file by path."""
    path = Path(name)
    if path.is_file():
        return path.resolve()
    shipped = MACHINES / f"{name}.txt"
    if shipped.is_file():
        return shipped
    raise FakeNvmlError(f"no machine {name!r}: give a description file or one of {', '.join(machines())}")


@dataclass(frozen=True, slots=True)
class FakeNvml:
    """One fake machine: the library, its description, the control file that scripts its faults and the file
    that records its memory limits."""

    library_dir: Path
    machine: Path
    control: Path
    limits_record: Path

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) plus what a process needs to load this machine."""
        env = dict(os.environ if base is None else base)
        search = [str(self.library_dir), *filter(None, env.get("LD_LIBRARY_PATH", "").split(":"))]
        env["LD_LIBRARY_PATH"] = ":".join(search)
        env[ENV_MACHINE] = str(self.machine)
        env[ENV_CONTROL] = str(self.control)
        env[ENV_LIMITS] = str(self.limits_record)
        return env

    def _record(self) -> Iterator[tuple[str, int, int, int, str]]:
        """The record's lines: (card UUID, own soft, own hard, held for descendants, cgroup path)."""
        for line in self.limits_record.read_text().splitlines():
            uuid, soft, hard, held, path = line.split(" ", 4)
            yield uuid, int(soft), int(hard), int(held), path

    def limits(self) -> dict[tuple[str, str], tuple[int, int]]:
        """The live memory limits as last recorded: (card UUID, cgroup path) -> the cgroup's own (soft, hard)
        in bytes, for the cgroups that have one."""
        return {
            (uuid, path): (soft, hard)
            for uuid, soft, hard, _, path in self._record()
            if (soft, hard) != (0, NO_HARD_LIMIT)
        }

    def held(self) -> dict[tuple[str, str], int]:
        """What each cgroup holds for its descendants' soft limits, as last recorded: (card UUID, cgroup path)
        -> bytes, for the cgroups that hold any. It outlives a descendant removed with its soft limit set."""
        return {(uuid, path): held for uuid, _, _, held, path in self._record() if held}

    @property
    def leaks_record(self) -> Path:
        return self.limits_record.with_name(self.limits_record.name + ".leaks")

    def leaks(self) -> list[tuple[str, int, str]]:
        """The soft limits whose cgroup was removed before they were cleared, in the order the library
        found them gone: (card UUID, soft bytes, cgroup path)."""
        if not self.leaks_record.exists():
            return []
        found = []
        for line in self.leaks_record.read_text().splitlines():
            uuid, soft, path = line.split(" ", 2)
            found.append((uuid, int(soft), path))
        return found

    def xid(self, uuid: str, xid: int) -> None:
        """Raise XID ``xid`` on the card, as the driver would report it."""
        self._command(f"xid {uuid} {xid}")

    def lose(self, uuid: str) -> None:
        """The card falls off the bus: NVML answers NVML_ERROR_GPU_IS_LOST for it."""
        self._command(f"lose {uuid}")

    def restore(self, uuid: str) -> None:
        self._command(f"restore {uuid}")

    def _command(self, line: str) -> None:
        with self.control.open("a") as f:
            f.write(line + "\n")


def prepare(machine: str, workdir: Path, cache: Path | None = None) -> FakeNvml:
    """Build the library ``machine`` needs if needed, and give it an empty control file and an empty record of
    memory limits in ``workdir``."""
    description = machine_file(machine)
    control = Path(workdir) / f"{description.stem}.nvml-control"
    control.write_text("")
    limits_record = Path(workdir) / f"{description.stem}.nvml-limits"
    limits_record.write_text("")
    limits_record.with_name(limits_record.name + ".leaks").unlink(missing_ok=True)
    library_dir = build(cache, memory_limits=has_memory_limits(description))
    return FakeNvml(library_dir, description, control, limits_record)
