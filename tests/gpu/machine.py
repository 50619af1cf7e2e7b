"""What the machine's NVIDIA driver says, read without gpushare: ``nvidia-smi``, ``/proc/driver/nvidia``,
sysfs and the cgroup files. Also the environment in which a child process loads the real driver library
and never the fake one (``gpushare/sandbox/fakenvml``), the test-owned cgroups the limit checks run in,
and the figures a run reports (:data:`FIGURES`, printed at its end by ``conftest.py``)."""

from __future__ import annotations

import csv
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from gpushare.memlimits.enforcer import NO_HARD_LIMIT
from gpushare.sandbox import fakenvml

HERE = Path(__file__).parent
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: the first driver release with per-cgroup memory limits (nvmlDeviceSetMemoryLimits_v1)
LIMITS_RELEASE = 615

#: what the checks measured, one line each, for whoever reports on the machine
FIGURES: list[str] = []


def figure(line: str) -> None:
    if line not in FIGURES:
        FIGURES.append(line)


def real_env() -> dict[str, str]:
    """This process's environment without anything that would make a child load the fake NVML: its
    variables, and ``LD_LIBRARY_PATH`` entries that hold a library built from ``fakenvml.c``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_FAKE_NVML")}
    kept = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d and not _holds_fake(Path(d))]
    env["LD_LIBRARY_PATH"] = ":".join(kept)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's ordinals in NVML's (and nvidia-smi's) order
    return env


#: a string of the fake library's own messages (fakenvml.c), found in its binary
_FAKE_MARK = b"fake NVML:"


def _holds_fake(directory: Path) -> bool:
    return _is_fake(directory / fakenvml.LIBRARY)


def _is_fake(library: Path) -> bool:
    try:
        return _FAKE_MARK in library.read_bytes()
    except OSError:
        return False


def run(argv: list[str], env: Mapping[str, str] | None = None, timeout: float = 120) -> str:
    """``argv``'s standard output; a failure raises, naming the command and its last error line."""
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout


#: a child that loads libnvidia-ml.so.1 and says which file it is and which driver it reports
_PROBE = """
import pynvml
pynvml.nvmlInit()
version = pynvml.nvmlSystemGetDriverVersion()
print(version.decode() if isinstance(version, bytes) else version)
for line in open("/proc/self/maps"):
    if "libnvidia-ml" in line:
        print(line.split()[-1])
        break
"""


def no_driver() -> str | None:
    """Why the checks can't run here (``no NVIDIA driver: ...``), or None on a machine whose NVIDIA
    driver is loaded and whose ``libnvidia-ml.so.1`` is that driver's, not the fake (which answers
    ``nvmlInit`` with no kernel module behind it). The kernel side shows as
    ``/proc/driver/nvidia/version``, or, in a sandboxed runtime that proxies the driver without its
    procfs files, as ``/dev/nvidiactl``."""
    if not DRIVER_VERSION_FILE.exists() and not Path("/dev/nvidiactl").exists():
        return f"no NVIDIA driver: neither {DRIVER_VERSION_FILE} nor /dev/nvidiactl exists (no nvidia kernel module)"
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA driver: nvidia-smi is not on PATH"
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=real_env(), capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"no NVIDIA driver: libnvidia-ml.so.1 can't be used: {last}"
    version, *library = done.stdout.split()
    if library and _is_fake(Path(library[0])):
        return f"no NVIDIA driver: the libnvidia-ml.so.1 found ({library[0]}) is gpushare's fake"
    if DRIVER_VERSION_FILE.exists() and version not in DRIVER_VERSION_FILE.read_text():
        return f"no NVIDIA driver: libnvidia-ml.so.1 is driver {version}, the kernel module is not"
    return None


@dataclass(frozen=True, slots=True)
class SmiCard:
    index: int
    uuid: str
    name: str
    memory_mib: int
    reserved_mib: int | None  # None where nvidia-smi says [N/A]
    bus_id: str  # sysfs form: 0000:18:00.0
    mig: bool


_SMI_FIELDS = "index,uuid,name,memory.total,memory.reserved,pci.bus_id,mig.mode.current"


def smi_cards() -> list[SmiCard]:
    """Every card as ``nvidia-smi --query-gpu`` lists it."""
    out = run(["nvidia-smi", f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader,nounits"])
    cards = []
    for row in csv.reader(line for line in out.splitlines() if line.strip()):
        index, uuid, name, total, reserved, bus, mig = (cell.strip() for cell in row)
        cards.append(
            SmiCard(int(index), uuid, name, int(total), int(reserved) if reserved.isdigit() else None, sysfs_bus(bus),
                    mig == "Enabled")
        )  # fmt: skip
    return cards


def sysfs_bus(bus_id: str) -> str:
    """``00000000:18:00.0`` (NVML, nvidia-smi) as sysfs writes it: ``0000:18:00.0``."""
    domain, rest = bus_id.lower().split(":", 1)
    return f"{domain[-4:]}:{rest}"


def minor_of(card: SmiCard) -> int:
    """The card's ``/dev/nvidia<minor>``, as the driver's ``information`` file says, or, where the
    runtime doesn't show that file, ``nvidia-smi -q``."""
    information = Path("/proc/driver/nvidia/gpus") / card.bus_id / "information"
    if information.exists():
        text, pattern = information.read_text(), r"^Device Minor:\s*(\d+)"
    else:
        text, pattern = run(["nvidia-smi", "-q", "-i", str(card.index)]), r"^\s*Minor Number\s*:\s*(\d+)"
    found = re.search(pattern, text, re.MULTILINE)
    assert found, f"card {card.index}: no minor number in:\n{text}"
    return int(found.group(1))


def numa_of(bus: str) -> tuple[bool, int | None]:
    """(whether sysfs shows the card, its NUMA node as the PCI bus says: None where it says -1)."""
    path = Path("/sys/bus/pci/devices") / bus / "numa_node"
    if not path.exists():
        return False, None
    node = int(path.read_text())
    return True, (node if node >= 0 else None)


def numa_node_count() -> int:
    return len(list(Path("/sys/devices/system/node").glob("node[0-9]*")))


def nvlink_pairs(count: int) -> set[frozenset[int]]:
    """Pairs of card indices that ``nvidia-smi topo -m`` shows joined by NVLink (``NV<n>``)."""
    if count < 2:
        return set()
    pairs = set()
    for line in run(["nvidia-smi", "topo", "-m"]).splitlines():
        fields = re.sub(r"\x1b\[[0-9;]*m", "", line).split()
        if not fields or not re.fullmatch(r"GPU\d+", fields[0]):
            continue
        row = int(fields[0][3:])
        for column, cell in enumerate(fields[1 : 1 + count]):
            if cell.startswith("NV"):
                pairs.add(frozenset((row, column)))
    return pairs


def driver_version() -> str:
    """The driver's version (580.95.05), as nvidia-smi reports it."""
    return run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).split()[0]


def driver_release() -> int:
    """The driver's major release (580 for 580.95.05)."""
    return int(driver_version().split(".")[0])


def binding_has_limits() -> bool:
    """Whether the installed NVML binding (nvidia-ml-py) has the per-cgroup memory-limit calls."""
    import pynvml

    return hasattr(pynvml, "nvmlDeviceGetMemoryLimits_v1")


def cgroup_fs() -> str:
    """The file system at /sys/fs/cgroup: ``cgroup2fs`` on a cgroup v2 machine."""
    return run(["stat", "-fc", "%T", str(CGROUP_ROOT)]).strip() if CGROUP_ROOT.is_dir() else "absent"


#: what gVisor's /proc/version says, whatever the host kernel is
_GVISOR_VERSION = "Linux version 4.4.0 #1 SMP Sun Jan 10 15:06:54 PST 2016"


def sandboxed() -> str | None:
    """What says this machine is a sandboxed runtime (gVisor), or None."""
    version = Path("/proc/version").read_text().strip()
    return f"gVisor (/proc/version: {version!r})" if version.startswith(_GVISOR_VERSION) else None


def dmem_capacity() -> list[str] | None:
    """The nvidia lines of ``/sys/fs/cgroup/dmem.capacity`` (one per card, ``nvidia/<pci>/vidmem SIZE``,
    where the driver chose the kernel's dmem controller as its backend), or None where the kernel has no
    such file (no dmem controller: the driver's own ``misc`` backend, if any)."""
    try:
        text = (CGROUP_ROOT / "dmem.capacity").read_text()
    except OSError:
        return None
    return [line.strip() for line in text.splitlines() if line.startswith("nvidia")]


def dmem_files(cgroup: Path) -> str:
    """What the kernel's dmem controller holds for ``cgroup`` on NVIDIA's regions (its dmem.min and
    dmem.max, which the driver writes under that backend), or that it has no such files."""
    said = []
    for name in ("dmem.min", "dmem.max"):
        try:
            lines = [line.strip() for line in (cgroup / name).read_text().splitlines() if line.startswith("nvidia")]
        except OSError:
            continue
        said.append(f"{name} {'; '.join(lines) or 'no nvidia line'}")
    return ", ".join(said) or "no dmem files"


def delegate_dmem(cgroup: Path) -> str:
    """Enable the dmem controller for ``cgroup``'s children where it offers it, as runc does on every
    cgroup above a container's when it makes the container's (opencontainers/cgroups, fs2/create.go,
    CreateCgroupPath: every available controller); what it found."""
    try:
        if "dmem" not in (cgroup / "cgroup.controllers").read_text().split():
            return "not offered (the kernel has no dmem controller there)"
        if "dmem" in (cgroup / "cgroup.subtree_control").read_text().split():
            return "enabled already"
        (cgroup / "cgroup.subtree_control").write_text("+dmem")
    except OSError as exc:
        return f"not enabled: {exc}"
    return "enabled by the test"


def gpushare(command: str, *args: str) -> str:
    """Run ``tests/gpu/nvmlnode.py`` (gpushare's NVML backend) on the real driver."""
    return run([sys.executable, str(HERE / "nvmlnode.py"), command, *args], env=real_env())


def inventory() -> list[dict]:
    return json.loads(gpushare("inventory"))


def cuda(uuid: str, cap: int, cgroup: Path | None = None) -> dict:
    """Run ``tests/gpu/cudadriver.py`` on card ``uuid`` (in ``cgroup`` when given: it is moved there
    before it touches the GPU), expecting a cap of ``cap`` bytes (0: none); its findings."""
    env = real_env() | {"CUDA_VISIBLE_DEVICES": uuid}
    argv = [sys.executable, str(HERE / "cudadriver.py"), str(cap)]
    with subprocess.Popen(
        argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as child:
        try:
            if cgroup is not None:
                (cgroup / "cgroup.procs").write_text(str(child.pid))
            out, err = child.communicate("go\n", timeout=120)
        except BaseException:
            child.kill()
            child.wait()
            raise
    assert child.returncode == 0, f"{' '.join(argv)} exited {child.returncode}: {err.strip()[-2000:]}"
    return json.loads(out)


@functools.cache
def _delegate_root_dmem() -> None:
    """Once a run: dmem for the root's children, and what was found."""
    figure(f"dmem for the children of {CGROUP_ROOT}: {delegate_dmem(CGROUP_ROOT)}")


@dataclass(slots=True)
class CgroupTree:
    """Cgroups a check makes under ``top``, and those it limited on card ``uuid``."""

    top: Path
    uuid: str
    limited: set[Path] = field(default_factory=set)

    def make(self, relative: str) -> Path:
        path = self.top / relative
        delegate_dmem(path.parent)
        path.mkdir()
        return path

    def limit(self, cgroup: Path, soft: int, hard: int) -> None:
        """Set ``cgroup``'s limits (bytes) on the card through the node agent's NVML backend."""
        self.limited.add(cgroup)
        gpushare("set", self.uuid, str(cgroup), str(soft), str(hard))

    def clear(self, cgroup: Path) -> None:
        """Take ``cgroup``'s limits off the card as gpushare does when a sandbox ends: soft 0 and hard
        NVML_DEVICE_MEMORY_LIMIT_MAX, in one call."""
        gpushare("set", self.uuid, str(cgroup), "0", str(NO_HARD_LIMIT))
        self.limited.discard(cgroup)


@contextmanager
def cgroup_tree(name: str, uuid: str) -> Iterator[CgroupTree]:
    """A cgroup ``/sys/fs/cgroup/<name>`` made for a check, and on every way out: the limits still set
    below it cleared (soft 0 before removal, which NVIDIA advises so that the reservations the driver made
    for a cgroup on its ancestors are given back: MPS v3 Memory Partitioning,
    https://docs.nvidia.com/deploy/mps/latest/mpsv3-memory-partitioning.html), then every cgroup below
    it and itself removed, children first."""
    _delegate_root_dmem()
    tree = CgroupTree(CGROUP_ROOT / name, uuid)
    tree.top.mkdir()
    try:
        yield tree
    finally:
        try:
            for cgroup in sorted(tree.limited, key=_deepest_first):
                if cgroup.is_dir():
                    tree.clear(cgroup)
        finally:
            for directory in sorted((p for p in tree.top.rglob("*") if p.is_dir()), key=_deepest_first):
                directory.rmdir()
            tree.top.rmdir()


def _deepest_first(path: Path) -> int:
    return -len(path.parts)
