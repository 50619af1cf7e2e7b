"""A simulated node's own cgroup root, so that its kubelet can give each pod a cgroup (``cgroupsPerQOS``)
without touching another node's or the machine's: ``/<name>`` in every cgroup hierarchy the machine
has mounted, made before the kubelet starts and removed, with whatever kubelet made below it, once the
node's processes have ended."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from gpushare.memlimits.cgroups import cgroup_mounts

log = logging.getLogger(__name__)


def make_cgroup_root(name: str) -> list[Path]:
    """``/<name>`` in every hierarchy of this machine; the directories made."""
    made = []
    for _, mount in cgroup_mounts(Path("/proc/self/mountinfo").read_text()):
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
