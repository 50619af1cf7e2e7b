"""The binaries build_kube.sh caches: it builds only those a cache lacks, each reports the version pinned,
``python -m gpushare.sandbox.binaries --require`` fails when one the tests need is not built, and
``--link`` puts kubectl, helm and crictl in the venv's bin."""

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
#: build_kube.sh's record of the default Kubernetes version stamped into the cached helm
HELM_MARKER = "helm.kube-version"
HELM_KUBE = f"1.{binaries._pinned('HELM_KUBE_MINOR')}"


def stub_cache(cache: Path, *lacking: str) -> None:
    """``cache`` holding an empty executable for every binary but those ``lacking``, helm with the marker of
    its default Kubernetes version."""
    cache.mkdir(exist_ok=True)
    for name in set(ALL) - set(lacking):
        (cache / name).write_text("#!/bin/sh\n")
        (cache / name).chmod(0o755)
    if binaries.HELM not in lacking:
        (cache / HELM_MARKER).write_text(f"{HELM_KUBE}\n")


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


def test_a_cached_helm_without_its_default_kubernetes_version_is_built_again(tmp_path: Path) -> None:
    """A helm cached before build_kube.sh stamped helm's default Kubernetes version renders no chart that
    needs 1.30 without --kube-version: it is built again, and nothing else."""
    cache = tmp_path / "cache"
    stub_cache(cache)
    (cache / HELM_MARKER).unlink()
    done = build_with_fake_go(tmp_path, cache)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "built").read_text().splitlines() == [f"helm.sh/helm/v3/cmd/helm@{binaries.HELM_VERSION}"]
    assert (cache / HELM_MARKER).read_text() == f"{HELM_KUBE}\n"


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


def test_the_user_tools_are_linked_from_the_cache_and_a_stale_link_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """install.sh's ``--link .venv/bin``: kubectl and helm are built, crictl is not (its old link goes, so
    PATH finds another crictl), and a file that isn't a link is the owner's and stays."""
    cache, bin_dir = tmp_path / "cache", tmp_path / "venv-bin"
    stub_cache(cache, binaries.CRICTL)
    bin_dir.mkdir()
    (bin_dir / binaries.CRICTL).symlink_to(tmp_path / "gone" / binaries.CRICTL)
    (bin_dir / "gpushare").write_text("#!/bin/sh\n")
    monkeypatch.setenv("GPUSHARE_KUBE_BIN", str(cache))
    for _ in range(2):  # a second install finds the links in place
        assert binaries.link_tools(bin_dir) == [binaries.KUBECTL, binaries.HELM]
        assert sorted(p.name for p in bin_dir.iterdir()) == ["gpushare", binaries.HELM, binaries.KUBECTL]
        assert all((bin_dir / n).resolve() == cache / n for n in (binaries.KUBECTL, binaries.HELM))


def test_a_hint_names_kubectl_by_its_full_path_unless_path_finds_the_cached_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, venv_bin, machine_bin = tmp_path / "cache", tmp_path / "venv-bin", tmp_path / "usr-bin"
    stub_cache(cache)
    venv_bin.mkdir()
    (venv_bin / binaries.KUBECTL).symlink_to(cache / binaries.KUBECTL)
    machine_bin.mkdir()
    (machine_bin / binaries.KUBECTL).write_text("#!/bin/sh\n")  # another version, as /usr/bin/kubectl
    (machine_bin / binaries.KUBECTL).chmod(0o755)
    monkeypatch.setenv("GPUSHARE_KUBE_BIN", str(cache))
    monkeypatch.setenv("PATH", f"{venv_bin}{os.pathsep}{machine_bin}")
    assert binaries.command(binaries.KUBECTL) == "kubectl"  # the venv is active
    monkeypatch.setenv("PATH", str(machine_bin))
    assert binaries.command(binaries.KUBECTL) == str(cache / binaries.KUBECTL)
