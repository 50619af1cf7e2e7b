"""What `pip install` puts in site-packages: one `gpushare` package holding every component, and no
generic top-level names such as `extender` or `webhook`."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ("deviceplugin", "draplugin", "crishim", "nriplugin", "advertiser", "extender", "webhook")


def test_every_package_folder_is_installed_and_listed_once() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = setuptools["packages"]
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in ROOT.glob("gpushare/**/__init__.py")} | {
        f"gpushare.{c}" for c in COMPONENTS
    }
    assert len(listed) == len(set(listed))
    assert set(listed) == folders, "a package folder is missing from pyproject.toml's packages list (or vice versa)"
    assert {k: v for k, v in setuptools["package-dir"].items() if k != "gpushare"} == {
        f"gpushare.{c}": c for c in COMPONENTS
    }


def test_the_wheel_holds_only_the_gpushare_namespace(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("gpushare-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"gpushare"}
    for component in COMPONENTS:
        modules = sorted((ROOT / component).rglob("*.py"))
        assert ROOT / component / "__init__.py" in modules
        for module in modules:
            assert f"gpushare/{component}/{module.relative_to(ROOT / component).as_posix()}" in names
    assert "gpushare/sandbox/fakenvml/fakenvml.c" in names
