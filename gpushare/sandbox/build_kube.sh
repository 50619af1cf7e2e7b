#!/usr/bin/env bash
# Builds kube-apiserver, kube-scheduler and kubelet v1.20.2 from Debian bookworm's source package, the
# way debian/rules does, and caches them. Only the first run on a machine pays the build (~10 min on
# 2 cores); later runs find the cache and return at once. Fetches nothing but Debian packages.
#
#   build_kube.sh [CACHE_DIR]     (default: $GPUSHARE_KUBE_BIN or /var/cache/gpushare/kube-v1.20.2)
set -euo pipefail
version=v1.20.2
cache=${1:-${GPUSHARE_KUBE_BIN:-/var/cache/gpushare/kube-$version}}
bins=(kube-apiserver kube-scheduler kubelet)

have_all() { for b in "${bins[@]}"; do [ -x "$cache/$b" ] || return 1; done; }
if have_all; then echo "build_kube: cached in $cache"; exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "build_kube: need root and apt-get to build Kubernetes $version; real-cluster parts will be skipped" >&2
  exit 1
fi

src_list=/etc/apt/sources.list.d/gpushare-bookworm-src.sources
if [ ! -f "$src_list" ]; then
  # the same mirror as the machine's own bookworm entry
  uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  cat >"$src_list" <<SRC
Types: deb-src
URIs: ${uri:-http://deb.debian.org/debian}
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq golang-go rsync etcd-server containernetworking-plugins \
  containerd runc busybox-static >/dev/null

work=$(mktemp -d /var/tmp/gpushare-kube-build.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$work"
apt-get source --download-only kubernetes >/dev/null 2>&1
dpkg-source --no-check -x kubernetes_*.dsc tree >/dev/null
tree=$work/tree
mkdir -p "$tree/.go/src/k8s.io"
ln -s "$tree" "$tree/.go/src/k8s.io/kubernetes"
cd "$tree/.go/src/k8s.io/kubernetes"
echo "build_kube: building ${bins[*]} $version (about 10 minutes on 2 cores)"
GOPATH=$tree/.go GO111MODULE=off GOFLAGS= CGO_ENABLED=0 GOCACHE=$work/gocache \
  make WHAT="cmd/kube-apiserver cmd/kube-scheduler cmd/kubelet" KUBE_GIT_VERSION=$version >"$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log" >&2; exit 1; }
mkdir -p "$cache"
for b in "${bins[@]}"; do install -m 0755 "_output/bin/$b" "$cache/$b.tmp" && mv "$cache/$b.tmp" "$cache/$b"; done
echo "build_kube: built into $cache"
