#!/usr/bin/env bash
# Installs everything gpushare, its sandbox and its tests need on a Debian machine.
# containerd, runc and busybox-static are only needed for real containers (sandbox, CRI shim tests),
# gcc only for the fake libnvidia-ml that the NVML tests and `gpushare sandbox --nvml-fake` load;
# they are installed when missing and we are root, and skipped with a note otherwise.
set -euo pipefail
cd "$(dirname "$0")"

missing=()
command -v containerd >/dev/null 2>&1 || missing+=(containerd)
command -v runc >/dev/null 2>&1 || missing+=(runc)
[ -x /bin/busybox ] || missing+=(busybox-static)
command -v gcc >/dev/null 2>&1 || missing+=(gcc)  # builds the fake libnvidia-ml for the NVML tests
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: installing ${missing[*]} with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "install.sh: ${missing[*]} missing and not root: real-container parts will be skipped" >&2
  fi
fi

python3 -m pip install -q --disable-pip-version-check -e '.[test]'
# pyenv only sees new console scripts (gpushare, kubectl-gpushare) after a rehash
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
