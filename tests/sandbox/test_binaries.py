"""The binaries build_kube.sh caches: it builds only those a cache lacks, each reports the version pinned, and
``python -m gpushare.sandbox.binaries --require`` fails when one the tests need is not built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpushare.sandbox import binaries

#: a `go` that builds nothing: it records the package of each `go build` and `go install` in $FAKE_GO_LOG,
#: writes an empty executable where the binary would go (or fails for the package $FAKE_GO_FAIL), and
#: answers what build_kube.sh asks of it
FAKE_GO = r"""#!/bin/sh
case "$1" in
  version) echo "go version go1.26.8 linux/amd64" ;;
  env) echo go1.26.8 ;;
  mod) printf 'module fake\n' >"$FAKE_GO_DIR/go.mod"; printf '{\n\t"GoMod": "%s",\n}\n' "$FAKE_GO_DIR/go.mod" ;;
  build|install)
    out=; prev=; for arg; do [ "$prev" = -o ] && out=$arg; prev=$arg; done
    echo "$arg" >>"$FAKE_GO_LOG"
    [ "$arg" = "$FAKE_GO_FAIL" ] && { echo "fake go: cannot build $arg" >&2; exit 1; }
    [ "$1" = install ] && out="$GOBIN/$(basename "${arg%@*}")"
    printf '#!/bin/sh\n' >"$out" && chmod +x "$out" ;;
  *) echo "fake go: unexpected $*" >&2; exit 2 ;;
esac
"""

ALL = (*binaries.KUBE_BINARIES, "etcd", *binaries.CONTAINERD_BINARIES, binaries.HELM, binaries.CRICTL)


def stub_cache(cache: Path, *lacking: str) -> None:
    """``cache`` holding an empty executable for every binary but those ``lacking``."""
    cache.mkdir(exist_ok=True)
    for name in set(ALL) - set(lacking):
        (cache / name).write_text("#!/bin/sh\n")
        (cache / name).chmod(0o755)


def build_with_fake_go(work: Path, cache: Path, fail: str = "") -> subprocess.CompletedProcess[str]:
    """build_kube.sh into ``cache`` with :data:`FAKE_GO` first on PATH; its log is ``work``/built."""
    fake = work / "bin"
    fake.mkdir()
    (fake / "go").write_text(FAKE_GO)
    (fake / "go").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
        "FAKE_GO_DIR": str(work),
        "FAKE_GO_LOG": str(work / "built"),
        "FAKE_GO_FAIL": fail,
    }
    return subprocess.run(
        ["bash", str(binaries.BUILD_SCRIPT), str(cache)], env=env, capture_output=True, text=True, check=False
    )


def test_a_cache_lacking_some_binaries_gets_only_those_built(tmp_path: Path) -> None:
    """A cache filled before kube-proxy and crictl were added gets those two, and no other binary again."""
    cache = tmp_path / "cache"
    stub_cache(cache, "kube-proxy", binaries.CRICTL)
    done = build_with_fake_go(tmp_path, cache)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "built").read_text().splitlines() == [
        "k8s.io/kubernetes/cmd/kube-proxy",
        f"sigs.k8s.io/cri-tools/cmd/crictl@{binaries.CRI_TOOLS_VERSION}",
    ]
    assert all(os.access(cache / name, os.X_OK) for name in ALL)


def test_a_binary_that_fails_to_build_fails_the_build_though_the_next_builds(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    stub_cache(cache, "kube-apiserver", "kube-proxy")
    done = build_with_fake_go(tmp_path, cache, fail="k8s.io/kubernetes/cmd/kube-apiserver")
    assert done.returncode == 1
    assert (cache / "BUILD-FAILED").read_text() == f"build_kube: building Kubernetes {binaries.KUBE_VERSION} failed\n"
    assert "fake go: cannot build k8s.io/kubernetes/cmd/kube-apiserver" in done.stderr


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("kube-proxy", f"kubernetes {binaries.KUBE_VERSION}"),
        (binaries.CRICTL, f"crictl version {binaries.CRI_TOOLS_VERSION}"),
    ],
)
def test_a_built_binary_reports_the_pinned_version(name: str, expected: str) -> None:
    if (why := binaries.missing((name,))) is not None:
        pytest.skip(why)
    done = subprocess.run([str(binaries.built(name)), "--version"], capture_output=True, text=True, check=False)
    assert done.stdout.strip() == expected, done.stderr


def test_require_fails_naming_crictl_when_it_is_not_built(tmp_path: Path) -> None:
    stub_cache(tmp_path, binaries.CRICTL)
    done = subprocess.run(
        [sys.executable, "-m", "gpushare.sandbox.binaries", "--require"],
        env={**os.environ, "GPUSHARE_KUBE_BIN": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1
    assert f"crictl: unavailable: crictl not built in {tmp_path}" in done.stdout
