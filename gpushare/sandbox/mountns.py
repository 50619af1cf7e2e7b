"""A private mount namespace held open by a sleeping process, for a simulated machine's programs: each
sees the machine's own directories at the paths a real host's programs use, and the host sees none of
its mounts."""

from __future__ import annotations

import contextlib
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

from gpushare.sandbox.launch import ClusterError

#: ``(own, target)``: bind ``own`` (a directory or a file) over ``target``; ``(None, target)``: mount an
#: empty tmpfs there. Targets under a tmpfs mounted before them exist only in the namespace; others are
#: made on the host's file systems if missing, and removed again when the namespace ends if still empty.
Mount = tuple[Path | None, Path]


class MountNamespace:
    """Start with :meth:`start`, run programs in it with :attr:`prefix`, end with :meth:`end`."""

    def __init__(self, name: str, cwd: Path, mounts: Sequence[Mount]) -> None:
        self.name = name
        self.cwd = cwd
        self.mounts = list(mounts)
        self.holder: subprocess.Popen[bytes] | None = None
        self._made: list[Path] = []

    @property
    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside the namespace."""
        assert self.holder is not None, f"{self.name}: its mount namespace is not started"
        return ["nsenter", f"--mount=/proc/{self.holder.pid}/ns/mnt", "--"]

    @property
    def root(self) -> Path:
        """The namespace's root directory as seen from the host: its private mounts are reachable below."""
        assert self.holder is not None, f"{self.name}: its mount namespace is not started"
        return Path(f"/proc/{self.holder.pid}/root")

    def _script(self) -> str:
        steps, private = [], []
        for own, target in self.mounts:
            where = shlex.quote(str(target))
            if own is None:
                steps.append(f"mount -t tmpfs -o mode=0755 tmpfs {where}")
                private.append(target)
                continue
            if own.is_file():
                steps.append(f'mkdir -p "$(dirname {where})" && touch {where}')
                steps.append(f"mount --bind {shlex.quote(str(own))} {where}")
                continue
            own.mkdir(parents=True, exist_ok=True)
            if any(target.is_relative_to(p) for p in private):
                steps.append(f"mkdir -p {where}")
            else:
                self._make_on_host(target)
            steps.append(f"mount --bind {shlex.quote(str(own))} {where}")
        return " && ".join(steps)

    def _make_on_host(self, target: Path) -> None:
        missing = [p for p in (target, *target.parents) if not p.exists()]
        target.mkdir(parents=True, exist_ok=True)
        self._made += missing

    def start(self) -> None:
        """:class:`ClusterError` naming the machine if a mount fails."""
        self.cwd.mkdir(parents=True, exist_ok=True)
        script = self._script()
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
             f"{script} && echo ready && exec sleep 2147483647"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
            cwd=self.cwd,
        )  # fmt: skip
        assert self.holder.stdout is not None
        if self.holder.stdout.readline().strip() != b"ready":
            self.holder.wait()
            err = self.holder.stderr.read().decode(errors="replace") if self.holder.stderr else ""
            raise ClusterError(f"{self.name}: could not make its mount namespace: {err.strip()}")

    def end(self) -> None:
        """End the holding process (its mounts go with it) and remove the host directories it made."""
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait()
        for made in self._made:
            if not _mounted_anywhere(made):
                with contextlib.suppress(OSError):  # something else put a file there
                    made.rmdir()
        self._made.clear()


def _mounted_anywhere(path: Path) -> bool:
    """Whether some process's mount namespace (another machine's) has a mount on ``path``: removing it
    on the host would take that mount away."""
    needle = f" {path} ".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "mountinfo").read_bytes():
                    return True
    return False
