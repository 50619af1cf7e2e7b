"""A simulated node's own cgroup root, so that its kubelet can give each pod a cgroup (``cgroupsPerQOS``)
without touching another node's or the machine's: ``/<name>`` in every cgroup hierarchy the machine
has mounted, made before the kubelet starts and removed, with whatever kubelet made below it, once the
node's processes have ended."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def hierarchies(mountinfo: str) -> list[Path]:
    """Where each cgroup hierarchy (v1 controllers and cgroup2) is mounted, from a mount table."""
    found = []
    for line in mountinfo.splitlines():
        if " - " in line and line.split(" - ", 1)[1].split()[0] in ("cgroup", "cgroup2"):
            found.append(Path(line.split()[4]))
    return found


def make_cgroup_root(name: str) -> list[Path]:
    """``/<name>`` in every hierarchy of this machine; the directories made."""
    made = []
    for mount in hierarchies(Path("/proc/self/mountinfo").read_text()):
        directory = mount / name
        directory.mkdir(exist_ok=True)
        made.append(directory)
    return made


def remove_cgroup_root(directories: list[Path]) -> None:
    """Remove each directory and the cgroups below it, deepest first (a cgroup is removed with rmdir,
    and only once no process is in it)."""
    for top in directories:
        for below, _, _ in sorted(os.walk(top), key=lambda entry: -entry[0].count("/")):
            with contextlib.suppress(FileNotFoundError):
                try:
                    os.rmdir(below)
                except OSError as exc:
                    log.warning("could not remove cgroup %s: %s", below, exc)
