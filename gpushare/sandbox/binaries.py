"""Where the real cluster's binaries (and helm and crictl) are, and which versions they are.

``gpushare/sandbox/build_kube.sh`` builds Kubernetes (kube-proxy and kubectl included), etcd, containerd,
helm and crictl from the Go module proxy into one cache directory (``install.sh`` runs it as root); the
versions below are the ones it pins, and the ones the real-cluster tests and ``gpushare sandbox`` run.
Tools that Debian packages (runc, the CNI plugins, busybox, openssl, unshare) are looked up on PATH.
``install.sh`` links the cache's kubectl, helm and crictl into the checkout's venv (:func:`link_tools`),
so that an activated venv runs these versions rather than whichever the machine has on PATH.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
from pathlib import Path

BUILD_SCRIPT = Path(__file__).with_name("build_kube.sh")


def _pinned(name: str) -> str:
    match = re.search(rf"^{name}=(\S+)$", BUILD_SCRIPT.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{BUILD_SCRIPT} pins no {name}")
    return match.group(1)


#: the versions build_kube.sh pins: one place states them
KUBE_VERSION = _pinned("KUBE_VERSION")
ETCD_VERSION = _pinned("ETCD_VERSION")
CONTAINERD_VERSION = _pinned("CONTAINERD_VERSION")
HELM_VERSION = _pinned("HELM_VERSION")
CRI_TOOLS_VERSION = _pinned("CRI_TOOLS_VERSION")
KUBE_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy", "kubectl")
CONTAINERD_BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr")
HELM = "helm"
CRICTL = "crictl"
KUBECTL = "kubectl"
#: the ones a person runs by hand against the sandbox or the test clusters
USER_TOOLS = (KUBECTL, HELM, CRICTL)
DEFAULT_BIN_DIR = Path(f"/var/cache/gpushare/kube-{KUBE_VERSION}")


def bin_dir() -> Path:
    """The cache build_kube.sh fills (``$GPUSHARE_KUBE_BIN`` moves it)."""
    return Path(os.environ.get("GPUSHARE_KUBE_BIN") or DEFAULT_BIN_DIR)


def built(name: str) -> Path:
    """The path of one cached binary (which may not exist: see :func:`missing`)."""
    return bin_dir() / name


def missing(names: tuple[str, ...]) -> str | None:
    """None when every binary in ``names`` is built, else one line saying why not: the build's own
    failure line when it failed, or which are missing and how to build them."""
    absent = [name for name in names if not os.access(built(name), os.X_OK)]
    if not absent:
        return None
    with contextlib.suppress(OSError):
        return (bin_dir() / "BUILD-FAILED").read_text().strip()
    return f"{', '.join(absent)} not built in {bin_dir()} (./install.sh builds them as root: {BUILD_SCRIPT.name})"


def path_with_bin_dir() -> str:
    """PATH with the cache first, so containerd finds its own runc shim and ctr before any other."""
    return f"{bin_dir()}{os.pathsep}{os.environ.get('PATH', os.defpath)}"


def link_tools(directory: Path) -> list[str]:
    """Link each of :data:`USER_TOOLS` that is built into ``directory`` (``install.sh``: the venv's bin), and
    remove a link there to one that is not, so that PATH finds another rather than a dangling link.
    Returns the names linked."""
    linked = []
    for name in USER_TOOLS:
        link = directory / name
        if missing((name,)) is None:
            partial = directory / f".{name}.{os.getpid()}"
            partial.unlink(missing_ok=True)
            partial.symlink_to(built(name))
            partial.rename(link)
            linked.append(name)
        elif link.is_symlink():
            link.unlink()
    return linked


def command(name: str) -> str:
    """How a person runs the cached ``name`` from a shell: the bare name when PATH finds this binary there
    (an activated venv, see :func:`link_tools`), else its full path, so that a hint never leads to another
    version on PATH (kubectl is supported within one minor version of kube-apiserver, and warns beyond:
    https://kubernetes.io/releases/version-skew-policy/#kubectl)."""
    found = shutil.which(name)
    if missing((name,)) is not None or (found is not None and Path(found).resolve() == built(name).resolve()):
        return name
    return str(built(name))


def host_tool_missing(names: tuple[str, ...]) -> str | None:
    """None when every tool in ``names`` is on PATH, else which one is not."""
    for name in names:
        if shutil.which(name) is None:
            return f"{name} is not installed (./install.sh installs it as root)"
    return None


if __name__ == "__main__":
    # the program also reports on the image and the real cluster, which build on this module, so it lives
    # above them; a -m run executes this file as __main__, never as the module they import
    from gpushare.sandbox.readiness import main

    sys.exit(main())
