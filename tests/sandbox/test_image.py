"""The image built from Debian's packages: its cache key, its OCI documents, and (with root, containerd and
a built image) that containerd imports it under the name deploy/*.yaml give and runs gpushare from it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from gpushare.sandbox import binaries, image
from gpushare.sandbox.containerd import K8S_NAMESPACE, Containerd, containerd_available

INPUTS = image.Inputs(
    packages=("Inst python3 (3.11.2-1+b1 Debian:12.12/stable [amd64])",),
    wheels=(("grpcio-1.85.1-cp311-cp311-manylinux_2_17_x86_64.whl", "ab" * 32),),
    source_tree="1" * 40,
    pip_version="23.2.1",
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
    finally:
        daemon.close()
