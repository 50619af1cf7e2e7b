"""``python -m gpushare.sandbox.binaries``: whether the real cluster, real containers, helm, crictl and the
gpushare image can run here, and on which versions. The program sits above :mod:`~gpushare.sandbox.image`
and :mod:`~gpushare.sandbox.realcluster`, which build on :mod:`~gpushare.sandbox.binaries`; that file
only runs it."""

from __future__ import annotations

import sys
from pathlib import Path

from gpushare.sandbox import binaries, image
from gpushare.sandbox.realcluster import realcluster_available


def main() -> int:
    """``python -m gpushare.sandbox.binaries --require``: exit 1 with the reason when the real cluster,
    real containers or the gpushare image can't run here, or helm or crictl isn't built, so that CI fails
    instead of skipping those tests. ``--link DIR``: :func:`~gpushare.sandbox.binaries.link_tools` into
    DIR, and nothing else."""
    if sys.argv[1:2] == ["--link"] and len(sys.argv) == 3:
        linked = binaries.link_tools(Path(sys.argv[2]))
        print(f"{', '.join(linked) or 'nothing'} linked into {sys.argv[2]} from {binaries.bin_dir()}")
        return 0
    cluster = realcluster_available()
    versions = (
        f"Kubernetes {binaries.KUBE_VERSION}, etcd {binaries.ETCD_VERSION}, containerd {binaries.CONTAINERD_VERSION}"
    )
    print(f"real cluster: {'unavailable: ' + cluster if cluster else versions}")
    tools = {binaries.HELM: binaries.HELM_VERSION, binaries.CRICTL: binaries.CRI_TOOLS_VERSION}
    tools_missing = {name: binaries.missing((name,)) for name in tools}
    for name, why in tools_missing.items():
        print(f"{name}: {'unavailable: ' + why if why else tools[name]}")
    image_missing = image.missing()
    print(f"image: {image_missing or f'{image.IMAGE} in {image.built()}'}")
    return 1 if (cluster or any(tools_missing.values()) or image_missing) and "--require" in sys.argv[1:] else 0
