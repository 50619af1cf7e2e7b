"""Where a container's cgroup is, read from plain text: the mount table says which cgroup layout the
node has and where its cgroup v2 hierarchy is; the container's runtime spec names its cgroup (in
cgroupfs or systemd form). Pure (strings in, paths out), but for :func:`pod_cgroups`, which lists
kubelet's pod cgroups."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

#: the layouts of a node's cgroups
V2, HYBRID, V1 = "v2", "hybrid", "v1"


@dataclass(frozen=True, slots=True)
class CgroupLayout:
    """The node's cgroup layout: ``v2`` (the unified hierarchy alone), ``hybrid`` (v1 controllers with a
    cgroup2 mount beside them) or ``v1``; ``unified`` is where cgroup2 is mounted, if anywhere (for
    ``v2``, the hierarchy the driver's limits apply to). ``problem`` overrides the reason limits
    can't apply (a ``--cgroup-root`` that is no cgroup2 mount)."""

    version: str
    unified: Path | None = None
    problem: str = ""

    @property
    def why_not(self) -> str | None:
        """Why the driver can't partition memory by cgroup on this layout, or None when it can."""
        if self.problem:
            return self.problem
        if self.version == V2:
            return None
        return f"cgroup {self.version} (the driver's memory limits need cgroup v2)"


#: a node whose layout nobody looked at: no limits
UNKNOWN_V1 = CgroupLayout(V1)


def cgroup_mounts(mountinfo: str) -> list[tuple[str, Path]]:
    """Each cgroup hierarchy a mount table (``/proc/PID/mountinfo``) shows: its file system type
    (``cgroup`` for a v1 hierarchy, ``cgroup2``) and where it is mounted, in table order."""
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype = line.split(" - ", 1)[1].split()[0]
        if fstype in ("cgroup", "cgroup2"):
            found.append((fstype, Path(fields[4])))
    return found


def detect_layout(mountinfo: str) -> CgroupLayout:
    """The layout that ``mountinfo`` shows: a cgroup2 mount and no v1 hierarchy is ``v2``; a cgroup2
    mount beside v1 hierarchies is ``hybrid``; no cgroup2 mount at all is ``v1``."""
    mounts = cgroup_mounts(mountinfo)
    unified = next((where for fstype, where in mounts if fstype == "cgroup2"), None)
    if unified is None:
        return CgroupLayout(V1)
    v1 = any(fstype == "cgroup" for fstype, _ in mounts)
    return CgroupLayout(HYBRID if v1 else V2, unified)


def given_root(root: Path, mountinfo: str) -> CgroupLayout:
    """The layout an operator names with ``--cgroup-root``: that cgroup2 mount (as ``mountinfo``
    shows it) is the hierarchy the driver partitions, whatever else is mounted; a path that is no
    cgroup2 mount point leaves limits off, saying so."""
    if ("cgroup2", root) in cgroup_mounts(mountinfo):
        return CgroupLayout(V2, root)
    return CgroupLayout(V1, None, f"--cgroup-root {root} is not a cgroup2 mount point")


def cgroup_dir(root: Path, cgroups_path: str) -> Path:
    """The directory of the cgroup a runtime spec's ``linux.cgroupsPath`` names, under the cgroup v2
    mount ``root``. cgroupfs form: an absolute path (``/kubepods/burstable/pod<uid>/<id>``); systemd
    form: ``slice:prefix:name`` (``kubepods-burstable-pod<uid>.slice:cri-containerd:<id>``), whose
    slice nests as systemd nests it (``a-b.slice`` in ``a.slice``) and whose unit is
    ``prefix-name.scope``."""
    if cgroups_path.count(":") == 2 and not cgroups_path.startswith("/"):
        slice_, prefix, name = cgroups_path.split(":")
        return root.joinpath(*_slice_dirs(slice_), f"{prefix}-{name}.scope" if prefix else f"{name}.scope")
    relative = PurePosixPath(cgroups_path)
    if not relative.is_absolute() or ".." in relative.parts:
        raise ValueError(f"cgroupsPath {cgroups_path!r} is neither an absolute cgroupfs path nor slice:prefix:name")
    return root.joinpath(*relative.parts[1:])


def _slice_dirs(slice_: str) -> list[str]:
    """``a-b-c.slice`` -> ``a.slice/a-b.slice/a-b-c.slice``; ``-.slice`` or empty is the root."""
    if slice_ in ("", "-.slice"):
        return []
    if not slice_.endswith(".slice"):
        raise ValueError(f"systemd slice {slice_!r} doesn't end in .slice")
    parts = slice_.removesuffix(".slice").split("-")
    return ["-".join(parts[: i + 1]) + ".slice" for i in range(len(parts))]


def unified_path(proc_cgroup: str) -> str | None:
    """A process's cgroup in the v2 hierarchy, from its ``/proc/PID/cgroup`` (the ``0::`` line)."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


#: a pod's cgroup as kubelet names it: ``pod<uid>`` (cgroupfs) or ``kubepods[-<qos>]-pod<uid>.slice``
#: (systemd, with the UID's dashes written as underscores)
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD_CGROUP = re.compile(rf"(?:^|-)pod({_UID})(?:\.slice)?$")
#: kubelet's QoS class cgroups below its root (cgroupfs, systemd)
_QOS = ("burstable", "besteffort", "kubepods-burstable.slice", "kubepods-besteffort.slice")


def pod_uid_of(name: str) -> str | None:
    """The pod UID a cgroup directory's name says it is kubelet's cgroup for, or None."""
    found = _POD_CGROUP.search(name)
    return found.group(1).replace("_", "-") if found else None


def kubepods_root(pod_cgroup: Path) -> Path:
    """Kubelet's pod hierarchy root (``kubepods``, ``kubepods.slice``) above one of its pod cgroups."""
    parent = pod_cgroup.parent
    return parent.parent if parent.name in _QOS else parent


def pod_cgroups(roots: Iterable[Path]) -> dict[str, Path]:
    """Every pod cgroup directly under ``roots`` (kubelet's pod hierarchy roots) or under their QoS
    class cgroups, by pod UID."""
    found: dict[str, Path] = {}
    for root in roots:
        for directory in (root, *(root / qos for qos in _QOS)):
            try:
                entries = [e for e in os.scandir(directory) if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            for entry in entries:
                if (uid := pod_uid_of(entry.name)) is not None:
                    found[uid] = Path(entry.path)
    return found
