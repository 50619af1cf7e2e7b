#!/usr/bin/env bash
# Builds the real cluster's binaries from the Go module proxy with the Go on PATH (1.26) and caches them:
#   kube-apiserver, kube-controller-manager, kube-scheduler,           k8s.io/kubernetes  $KUBE_VERSION
#     kubelet, kube-proxy, kubectl
#   etcd                                                               go.etcd.io/etcd/server/v3  $ETCD_VERSION
#   containerd, containerd-shim-runc-v2, ctr                           containerd/v2  $CONTAINERD_VERSION
#   helm                                                               helm.sh/helm/v3  $HELM_VERSION
#   crictl                                                             sigs.k8s.io/cri-tools  $CRI_TOOLS_VERSION
# k8s.io/kubernetes and etcd can't be `go install`ed: their go.mod replaces their own sub-modules with
# relative paths. Each is built from a small wrapper module that requires the release and replaces every
# such sub-module with its published version at the same tag. The first run on a machine pays for the
# downloads and the build (see README); later runs find the cache and return at once, and a cache that
# lacks some binaries (one filled before kube-proxy and crictl were added, say) gets only those built.
#
#   build_kube.sh [CACHE_DIR]   (default: $GPUSHARE_KUBE_BIN or /var/cache/gpushare/kube-$KUBE_VERSION)
set -euo pipefail
KUBE_VERSION=v1.37.2
ETCD_VERSION=v3.6.16
CONTAINERD_VERSION=v2.2.9
# helm v3, not v4: v3 is what charts and platform teams run today, and the chart (apiVersion v2) installs
# with either. v3.22.0 is the newest v3 release on the proxy; its client-go is the v0.37 line, as ours.
HELM_VERSION=v3.22.0
# crictl, the CRI client, at the release that goes with Kubernetes $KUBE_VERSION's minor version
CRI_TOOLS_VERSION=v1.37.0
cache=${1:-${GPUSHARE_KUBE_BIN:-/var/cache/gpushare/kube-$KUBE_VERSION}}
kube_bins=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl)
containerd_bins=(containerd containerd-shim-runc-v2 ctr)

# helm's default Kubernetes version (what `helm template` checks a chart's kubeVersion against without
# --kube-version): release builds stamp their client-go's, v1.37 for helm v3.22 (its Makefile's
# K8S_MODULES_*_VER); unstamped it is v1.20.0, which refuses the chart (kubeVersion >=1.30). A cached
# helm without the marker below predates the stamp and is built again.
HELM_KUBE_MINOR=37
# cached BINARY...: whether every one of them is already in the cache
cached() { for b in "$@"; do [ -x "$cache/$b" ] || return 1; done; }
# lacking BINARY...: those of them the cache lacks, one a line
lacking() { for b in "$@"; do [ -x "$cache/$b" ] || echo "$b"; done; }
[ "$(cat "$cache/helm.kube-version" 2>/dev/null)" = "1.$HELM_KUBE_MINOR" ] || rm -f "$cache/helm"
if cached "${kube_bins[@]}" etcd "${containerd_bins[@]}" helm crictl; then echo "build_kube: cached in $cache"; exit 0; fi
mkdir -p "$cache"
work=$(mktemp -d /var/tmp/gpushare-kube-build.XXXXXX)
trap 'rm -rf "$work"' EXIT
export GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0

# fail WHAT LOG: one line on stderr and in $cache/BUILD-FAILED (the tests' skip reason), then the log's tail
fail() {
  echo "build_kube: $1" | tee "$cache/BUILD-FAILED" >&2
  tail -30 "$2" >&2
  exit 1
}

# wrapper MODULE VERSION DIR SUBVERSION: a module in DIR that requires MODULE@VERSION and replaces each of
# its relative-path replaces (`X => ./...` or `X => ../...`) with X@SUBVERSION.
wrapper() {
  local module=$1 version=$2 dir=$3 subversion=$4 gomod
  mkdir -p "$dir"
  gomod=$(cd "$dir" && go mod download -json "$module@$version" 2>&1 | sed -n 's/^\s*"GoMod": "\(.*\)",$/\1/p') || true
  [ -s "$gomod" ] || fail "the Go module proxy has no $module@$version" /dev/null
  {
    echo "module gpushare.local/build"
    echo "go $(go env GOVERSION | sed 's/^go//; s/\.[0-9]*$//')"
    echo "require $module $version"
    awk -v v="$subversion" '$2 == "=>" && $3 ~ /^\.\.?\// && $3 !~ /FORBIDDEN/ {print "replace " $1 " => " $1 " " v}' "$gomod"
  } >"$dir/go.mod"
}

stamp="-X k8s.io/component-base/version.gitVersion=$KUBE_VERSION -X k8s.io/component-base/version.gitMajor=1
  -X k8s.io/component-base/version.gitMinor=$(echo "$KUBE_VERSION" | cut -d. -f2)
  -X k8s.io/component-base/version.gitTreeState=clean
  -X k8s.io/component-base/version/verflag.programName=kubernetes"
echo "build_kube: building what $cache lacks of Kubernetes $KUBE_VERSION, etcd $ETCD_VERSION, containerd $CONTAINERD_VERSION, helm $HELM_VERSION and crictl $CRI_TOOLS_VERSION with $(go version | cut -d' ' -f3)"
start=$SECONDS
command -v go >/dev/null 2>&1 || fail "no go on PATH (Go 1.26 builds these)" /dev/null

mapfile -t kube_todo < <(lacking "${kube_bins[@]}")
[ ${#kube_todo[@]} = 0 ] || {
  wrapper k8s.io/kubernetes "$KUBE_VERSION" "$work/kube" "v0.${KUBE_VERSION#v1.}"
  ( cd "$work/kube"
    for b in "${kube_todo[@]}"; do
      go build -trimpath -ldflags "-s -w $stamp" -o "$cache/$b.tmp" "k8s.io/kubernetes/cmd/$b" && mv "$cache/$b.tmp" "$cache/$b" || exit
    done ) >"$work/kube.log" 2>&1 || fail "building Kubernetes $KUBE_VERSION failed" "$work/kube.log"
}

cached etcd || {
  wrapper go.etcd.io/etcd/server/v3 "$ETCD_VERSION" "$work/etcd" "$ETCD_VERSION"
  ( cd "$work/etcd"
    go build -trimpath -ldflags "-s -w" -o "$cache/etcd.tmp" go.etcd.io/etcd/server/v3 && mv "$cache/etcd.tmp" "$cache/etcd"
  ) >"$work/etcd.log" 2>&1 || fail "building etcd $ETCD_VERSION failed" "$work/etcd.log"
}

# containerd 2: kubelet from 1.36 on no longer supports containerd 1.x (Debian bookworm ships 1.6.20)
mapfile -t containerd_todo < <(lacking "${containerd_bins[@]}")
[ ${#containerd_todo[@]} = 0 ] || {
  mkdir -p "$work/containerd"
  ( cd "$work/containerd" && printf 'module gpushare.local/build\ngo 1.26\nrequire github.com/containerd/containerd/v2 %s\n' "$CONTAINERD_VERSION" >go.mod
    ld="-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
    for b in "${containerd_todo[@]}"; do
      go build -trimpath -tags "no_btrfs no_zfs no_devmapper no_aufs" -ldflags "$ld" -o "$cache/$b.tmp" \
        "github.com/containerd/containerd/v2/cmd/$b" && mv "$cache/$b.tmp" "$cache/$b" || exit
    done ) >"$work/containerd.log" 2>&1 || fail "building containerd $CONTAINERD_VERSION failed" "$work/containerd.log"
}

# go_install NAME PACKAGE VERSION LDFLAGS: NAME, when the cache lacks it, by `go install PACKAGE@VERSION`,
# which builds it as its module's own go.mod pins (helm and cri-tools have no relative-path replaces)
go_install() {
  local name=$1 package=$2 version=$3 ldflags=$4
  cached "$name" && return
  mkdir -p "$work/$name"
  ( cd "$work/$name"
    GOBIN="$work/$name" go install -trimpath -ldflags "-s -w $ldflags" "$package@$version" \
      && cp "$work/$name/$name" "$cache/$name.tmp" && mv "$cache/$name.tmp" "$cache/$name"
  ) >"$work/$name.log" 2>&1 || fail "building $name $version failed" "$work/$name.log"
}

# each version string is stamped into the variable the project's Makefile sets (`helm version` otherwise
# says only "v3.22", `crictl --version` "unknown"), and helm's default Kubernetes version as above
helm_kube=""
for pkg in chartutil lint/rules; do
  helm_kube+=" -X helm.sh/helm/v3/pkg/$pkg.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/$pkg.k8sVersionMinor=$HELM_KUBE_MINOR"
done
go_install helm helm.sh/helm/v3/cmd/helm "$HELM_VERSION" \
  "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean$helm_kube"
echo "1.$HELM_KUBE_MINOR" >"$cache/helm.kube-version"
go_install crictl sigs.k8s.io/cri-tools/cmd/crictl "$CRI_TOOLS_VERSION" \
  "-X sigs.k8s.io/cri-tools/pkg/version.Version=$CRI_TOOLS_VERSION"

rm -f "$cache/BUILD-FAILED"
echo "build_kube: built into $cache in $((SECONDS - start)) s"
