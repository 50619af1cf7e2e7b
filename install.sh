#!/usr/bin/env bash
# Installs everything gpushare, its sandbox and its tests need on a Debian machine.
# runc and busybox-static run real containers (sandbox, CRI shim tests); gcc builds the fake libnvidia-ml
# that the NVML tests and `gpushare sandbox --nvml-fake` load; containernetworking-plugins give pods their
# network, and nftables holds kube-proxy's rules. Kubernetes (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, kube-proxy), etcd, containerd, crictl and helm are built from the Go module
# proxy with the Go on PATH by gpushare/sandbox/build_kube.sh and cached; so is the gpushare image, which
# gpushare/sandbox/image.py builds with mmdebstrap. They are installed when missing and we are root with
# apt-get; otherwise those parts are skipped with a note.
set -euo pipefail
cd "$(dirname "$0")"

as_root_with_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }

missing=()
command -v runc >/dev/null 2>&1 || missing+=(runc)
[ -x /bin/busybox ] || missing+=(busybox-static)
command -v gcc >/dev/null 2>&1 || missing+=(gcc)  # builds the fake libnvidia-ml for the NVML tests
[ -x /usr/lib/cni/loopback ] || missing+=(containernetworking-plugins)
command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)  # the gpushare image's root filesystem
command -v zstd >/dev/null 2>&1 || missing+=(zstd)              # and its compressed layer
command -v nft >/dev/null 2>&1 || missing+=(nftables)           # kube-proxy's rules in the Helm install tests
if [ ${#missing[@]} -gt 0 ]; then
  if as_root_with_apt; then
    echo "install.sh: installing ${missing[*]} with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "install.sh: ${missing[*]} missing and not root: real-container and real-cluster parts will be skipped" >&2
  fi
fi

if as_root_with_apt; then
  # the first run on a machine builds them (see README for the time and download); later runs find the cache
  gpushare/sandbox/build_kube.sh || echo "install.sh: the real-cluster tests will be skipped" >&2
fi

python3 -m pip install -q --disable-pip-version-check -e '.[test]'
# pyenv only sees new console scripts (gpushare, kubectl-gpushare) after a rehash
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi

if as_root_with_apt; then
  # the image deploy/*.yaml name, from Debian's packages; cached by its inputs' hash
  python3 -m gpushare.sandbox.image || echo "install.sh: the gpushare image was not built" >&2
else
  echo "install.sh: not root with apt-get: Kubernetes and the image not built, their tests will be skipped" >&2
fi
