"""Where the real cluster's binaries (and helm and crictl) are, and which versions they are.

``gpushare/sandbox/build_kube.sh`` builds Kubernetes (kube-proxy and kubectl included), etcd, containerd,
helm and crictl from the Go module proxy into one cache directory (``install.sh`` runs it as root); the
versions below are the ones it pins, and the ones the real-cluster tests and ``gpushare sandbox`` run.
Tools that Debian packages (runc, the CNI plugins, busybox, openssl, unshare) are looked up on PATH.
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


def host_tool_missing(names: tuple[str, ...]) -> str | None:
    """None when every tool in ``names`` is on PATH, else which one is not."""
    for name in names:
        if shutil.which(name) is None:
            return f"{name} is not installed (./install.sh installs it as root)"
    return None


def main() -> int:
    """``python -m gpushare.sandbox.binaries --require``: exit 1 with the reason when the real cluster,
    real containers or the gpushare image can't run here, or helm or crictl isn't built, so that CI fails
    instead of skipping those tests."""
    from gpushare.sandbox import image
    from gpushare.sandbox.realcluster import realcluster_available

    cluster = realcluster_available()
    versions = f"Kubernetes {KUBE_VERSION}, etcd {ETCD_VERSION}, containerd {CONTAINERD_VERSION}"
    print(f"real cluster: {'unavailable: ' + cluster if cluster else versions}")
    tools = {HELM: HELM_VERSION, CRICTL: CRI_TOOLS_VERSION}
    tools_missing = {name: missing((name,)) for name in tools}
    for name, why in tools_missing.items():
        print(f"{name}: {'unavailable: ' + why if why else tools[name]}")
    image_missing = image.missing()
    print(f"image: {image_missing or f'{image.IMAGE} in {image.built()}'}")
    return 1 if (cluster or any(tools_missing.values()) or image_missing) and "--require" in sys.argv[1:] else 0


if __name__ == "__main__":
    sys.exit(main())
