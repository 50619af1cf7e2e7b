"""What clusters on one machine can't share, each claimed by name before a cluster touches the host.

The simulated clusters share the host's network namespace: a routed cluster's fixed addresses and
routes, or one of the address blocks the nodes' kubelets serve on, can belong to one cluster at a time.
A lease is an exclusive ``flock(2)`` on ``LEASE_DIR/NAME.lock``, which holds the holder's directory and
pid, so a second cluster is refused naming the first; the kernel releases it when its holder exits,
however it exits. The file then still names the last holder, so the next one can remove what a holder
killed before its clean-up left behind (:attr:`Lease.previous`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from gpushare.sandbox.launch import ClusterError

#: root's, as the clusters are; emptied at boot, as the leases' subjects (links, routes) are
LEASE_DIR = Path("/run/gpushare-sandbox")


@dataclass
class Lease:
    name: str
    fd: int
    #: the directory the last holder recorded (gone, as the lease was free; maybe this one's), if any
    previous: Path | None

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the only descriptor releases the lock
            self.fd = -1


def _holder(text: str) -> tuple[Path | None, str]:
    """(directory, pid) from a lease file's ``DIRECTORY PID`` line."""
    directory, _, pid = text.strip().rpartition(" ")
    return (Path(directory), pid) if directory and pid.isdigit() else (None, "")


def try_claim(name: str, workdir: Path, directory: Path | None = None) -> Lease | None:
    """The lease ``name`` for the cluster in ``workdir``, or None while another process holds it (or this
    one, through another lease)."""
    directory = directory or LEASE_DIR
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:
        previous, _ = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{workdir} {os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return Lease(name, fd, previous)


def holder(name: str, directory: Path | None = None) -> str:
    """Who holds lease ``name``, for an error message: ``the cluster in DIR (pid N)``."""
    directory = directory or LEASE_DIR
    with contextlib.suppress(OSError):
        found, pid = _holder((directory / f"{name}.lock").read_text())
        if found is not None:
            return f"the cluster in {found} (pid {pid})"
    return "another process"


def claim(name: str, workdir: Path, what: str, directory: Path | None = None) -> Lease:
    """The lease ``name``, or :class:`ClusterError` naming ``what`` it guards and who holds it."""
    lease = try_claim(name, workdir, directory)
    if lease is None:
        raise ClusterError(f"{what} is in use by {holder(name, directory)}; stop that cluster first")
    return lease


def claim_first_free(
    prefix: str, slots: int, workdir: Path, what: str, directory: Path | None = None
) -> tuple[int, Lease]:
    """The first free of the leases ``PREFIX-0`` .. ``PREFIX-(slots-1)`` and its number, or
    :class:`ClusterError` naming ``what`` they guard when every one is held."""
    for slot in range(slots):
        lease = try_claim(f"{prefix}-{slot}", workdir, directory)
        if lease is not None:
            return slot, lease
    raise ClusterError(
        f"all {slots} {what} are in use by other clusters on this machine (leases in {directory or LEASE_DIR})"
    )
