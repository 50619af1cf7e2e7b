#!/usr/bin/env bash
# Installs everything gpushare, its sandbox and its tests need on a Debian machine.
# runc and busybox-static run real containers (sandbox, CRI shim tests); gcc builds the fake libnvidia-ml
# that the NVML tests and `gpushare sandbox --nvml-fake` load; containernetworking-plugins give pods their
# network, and nftables holds kube-proxy's rules. Kubernetes (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, kube-proxy), etcd, containerd, crictl and helm are built from the Go module
# proxy with the Go on PATH by gpushare/sandbox/build_kube.sh and cached; so is the gpushare image, which
# gpushare/sandbox/image.py builds with mmdebstrap. They are installed when missing and we are root with
# apt-get; otherwise those parts are skipped with a note.
#
# The package, its test extras and its commands (gpushare, kubectl-gpushare) go into this checkout's own
# virtual environment, .venv/, never into the machine's interpreter, where another checkout's install or
# the machine's own packages would move them; the cache's kubectl, helm and crictl are linked into
# .venv/bin, so `. .venv/bin/activate` runs the versions the sandbox and the tests run. A second run
# reinstalls only when pyproject.toml changed.
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
python3 -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)  # Debian's python3 makes venvs with it
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

venv=.venv
if ! "$venv/bin/python3" -c '' 2>/dev/null; then
  if python3 -c 'import ensurepip' 2>/dev/null; then
    python3 -m venv --clear "$venv"
  else  # Debian's python3 without python3-venv, and not root: the machine's pip puts pip in the venv
    python3 -m venv --clear --without-pip "$venv"
    python3 -m pip -q --disable-pip-version-check --python "$venv/bin/python3" install pip
  fi
fi
# the install is editable: only a changed pyproject.toml (dependencies, commands, packages) needs another
stamp="$venv/gpushare-pyproject.sha256"
if ! sha256sum --status -c "$stamp" 2>/dev/null; then
  "$venv/bin/python3" -m pip install -q --disable-pip-version-check -e '.[test]'
  sha256sum pyproject.toml >"$stamp"
fi
"$venv/bin/python3" -m gpushare.sandbox.binaries --link "$venv/bin"

if as_root_with_apt; then
  # the image deploy/*.yaml name, from Debian's packages; cached by its inputs' hash, and recorded for
  # this checkout in build/gpushare.oci.tar
  "$venv/bin/python3" -m gpushare.sandbox.image || echo "install.sh: the gpushare image was not built" >&2
else
  echo "install.sh: not root with apt-get: Kubernetes and the image not built, their tests will be skipped" >&2
fi
