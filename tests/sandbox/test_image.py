"""The image built from Debian's packages: its cache key, its OCI documents, each checkout's record of the
archive it built in the shared cache, and (with root, containerd and a built image) that containerd imports
it under the name deploy/*.yaml give and runs gpushare from it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from gpushare.sandbox import binaries, image
from gpushare.sandbox.containerd import K8S_NAMESPACE, Containerd, containerd_available

INPUTS = image.Inputs(
    packages=("Inst python3 (3.11.2-1+b1 Debian:12.12/stable [amd64])",),
    wheels=(("grpcio-1.85.1-cp311-cp311-manylinux_2_17_x86_64.whl", "ab" * 32),),
    source_tree="1" * 40,
    pip_version="23.2.1",
    kube_binaries=(("kube-scheduler", "ef" * 32),),
    recipe="recipe",
)


def test_the_name_is_the_one_kubelet_asks_containerd_for() -> None:
    assert image.containerd_name("gpushare:0.1.0") == "docker.io/library/gpushare:0.1.0"
    assert image.containerd_name("team/gpushare:1") == "docker.io/team/gpushare:1"
    assert image.containerd_name("registry.example:5000/gpushare:1") == "registry.example:5000/gpushare:1"


def test_the_same_inputs_give_the_same_key() -> None:
    assert image.cache_key(INPUTS) == image.cache_key(dataclasses.replace(INPUTS))


@pytest.mark.parametrize(
    "change",
    [
        {"packages": ("Inst python3 (3.11.2-1+b2 Debian-Security:12/stable-security [amd64])",)},
        {"wheels": ((INPUTS.wheels[0][0], "cd" * 32),)},
        {"source_tree": "2" * 40},
        {"pip_version": "24.0"},
        {"kube_binaries": (("kube-scheduler", "01" * 32),)},
        {"recipe": "recipe, changed"},
    ],
)
def test_a_changed_input_rebuilds(change: dict[str, object]) -> None:
    assert image.cache_key(dataclasses.replace(INPUTS, **change)) != image.cache_key(INPUTS)  # type: ignore[arg-type]


def test_the_package_set_is_apts_install_lines_in_order() -> None:
    output = "I: chroot\nInst b (2 x)\nConf b (2 x)\nInst a (1 x)\nInst b (2 x)\n"
    assert image.inst_lines(output) == ("Inst a (1 x)", "Inst b (2 x)")


def test_the_oci_documents_name_each_other_by_digest() -> None:
    layer = {"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd", "digest": "sha256:" + "0" * 64, "size": 9}
    raw_config, raw_manifest, raw_index = image.oci_documents("gpushare:0.1.0", layer, "sha256:" + "1" * 64, "amd64", 0)
    config, manifest, index = json.loads(raw_config), json.loads(raw_manifest), json.loads(raw_index)
    assert manifest["config"]["digest"] == "sha256:" + hashlib.sha256(raw_config).hexdigest()
    assert manifest["config"]["size"] == len(raw_config) and manifest["layers"] == [layer]
    (entry,) = index["manifests"]
    assert entry["digest"] == "sha256:" + hashlib.sha256(raw_manifest).hexdigest()
    assert entry["annotations"]["io.containerd.image.name"] == "docker.io/library/gpushare:0.1.0"
    assert (
        entry["platform"] == {"architecture": "amd64", "os": "linux"} == {k: config[k] for k in ("architecture", "os")}
    )
    assert config["rootfs"]["diff_ids"] == ["sha256:" + "1" * 64]
    assert config["created"] == "1970-01-01T00:00:00Z"
    assert config["config"]["Env"][0].startswith(f"PATH={image.VENV}/bin:")


def _unavailable() -> str | None:
    return containerd_available() or image.missing()


@pytest.mark.skipif(_unavailable() is not None, reason=f"needs the built image in containerd: {_unavailable()}")
def test_containerd_runs_gpushare_from_the_image_the_manifests_name(tmp_path: Path) -> None:
    daemon = Containerd(tmp_path / "containerd")
    ctr = [str(binaries.built("ctr")), "-a", str(daemon.socket), "-n", K8S_NAMESPACE]
    try:
        daemon.start()
        daemon.import_image(image.built())
        names = subprocess.run([*ctr, "images", "ls", "-q"], capture_output=True, text=True, check=True).stdout
        assert image.containerd_name(image.IMAGE) in names.split()
        run = [*ctr, "run", "--rm", "--snapshotter", "native", image.containerd_name(image.IMAGE), "image-test"]
        result = subprocess.run([*run, "gpushare", "--help"], capture_output=True, text=True, check=False)
        assert result.returncode == 0 and "usage: gpushare" in result.stdout, result.stderr
        # the chart's scheduler Deployment runs the cache's own kube-scheduler, as its non-root user
        as_nobody = [*run[:-2], "--user", "65534:65534", image.containerd_name(image.IMAGE), "image-kube-scheduler"]
        result = subprocess.run(
            [*as_nobody, "sha256sum", "/usr/local/bin/kube-scheduler"], capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stderr
        built = hashlib.sha256(binaries.built("kube-scheduler").read_bytes()).hexdigest()
        assert result.stdout.split()[0] == built
    finally:
        daemon.close()


def archive(cache: Path, key: str, age: float) -> Path:
    """An archive in ``cache`` last used ``age`` seconds ago."""
    path = cache / f"{key}.oci.tar"
    path.write_bytes(key.encode())
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_two_checkouts_sharing_the_cache_each_import_their_own_image(tmp_path: Path) -> None:
    cache = tmp_path / "image"
    cache.mkdir()
    (cache / image.ARCHIVE_NAME).symlink_to("a" * 16 + ".oci.tar")  # a cache-wide "latest" link goes
    first, second = tmp_path / "one" / "build" / image.ARCHIVE_NAME, tmp_path / "two" / "build" / image.ARCHIVE_NAME
    image.keep(archive(cache, "a" * 16, 60), first)
    image.keep(archive(cache, "b" * 16, 60), second)  # the second checkout builds after the first
    assert image.built(first).read_bytes() == b"a" * 16 and image.built(second).read_bytes() == b"b" * 16
    assert image.missing(first) is None and image.missing(second) is None
    assert sorted(p.name for p in cache.iterdir()) == [f"{k * 16}.oci.tar" for k in "ab"]


def test_the_cache_keeps_the_archives_used_last(tmp_path: Path) -> None:
    cache = tmp_path / "image"
    cache.mkdir()
    oldest, old, recent = (archive(cache, key * 16, age) for key, age in (("a", 300), ("b", 200), ("c", 100)))
    record = tmp_path / "checkout" / "build" / image.ARCHIVE_NAME
    image.keep(oldest, record, newest=2)  # found in the cache: used now, so kept
    assert sorted(cache.iterdir()) == [oldest, recent]
    assert image.built(record) == oldest
    image.keep(archive(cache, "d" * 16, 0), tmp_path / "another" / image.ARCHIVE_NAME, newest=2)
    assert not recent.exists()
    assert not old.exists()
    assert image.missing(record) is None


def test_a_checkout_whose_archive_left_the_cache_is_told_to_build_it(tmp_path: Path) -> None:
    record = tmp_path / "build" / image.ARCHIVE_NAME
    assert "not built for this checkout" in str(image.missing(record))
    record.parent.mkdir()
    record.symlink_to(tmp_path / "image" / ("a" * 16 + ".oci.tar"))
    assert f"{'a' * 16}.oci.tar, the image this checkout built, is gone from the cache" in str(image.missing(record))


def test_the_image_source_is_the_working_tree_with_its_new_files_and_the_index_is_untouched(tmp_path: Path) -> None:
    """A new module the checkout's tests import is in the image too; ignored files are not; force-added
    ones stay; the same files give the same commit."""
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / ".gitignore").write_text("build/\n")
    (tmp_path / "module.py").write_text("old\n")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "forced").write_text("kept\n")
    subprocess.run([*git, "add", ".gitignore", "module.py"], check=True)
    subprocess.run([*git, "add", "-f", "build/forced"], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    (tmp_path / "module.py").write_text("changed\n")
    (tmp_path / "new_module.py").write_text("new\n")
    (tmp_path / "build" / "artefact").write_text("ignored\n")
    status = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True, check=True).stdout

    commit = image.source_commit(tmp_path)
    files = subprocess.run([*git, "ls-tree", "-r", "--name-only", commit], capture_output=True, text=True, check=True)
    assert files.stdout.split() == [".gitignore", "build/forced", "module.py", "new_module.py"]
    shown = subprocess.run([*git, "show", f"{commit}:module.py"], capture_output=True, text=True, check=True)
    assert shown.stdout == "changed\n"
    assert subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True, check=True).stdout == status
    assert image.source_commit(tmp_path) == commit
