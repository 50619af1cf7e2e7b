"""What ``install.sh`` leaves on a machine: gpushare in the checkout's own venv (``.venv/``), never in the
machine's interpreter; a second run that reinstalls nothing unless pyproject.toml changed; the cache's
kubectl, helm and crictl in the venv's bin; and CI running exactly the README's test command in that venv.

The install.sh runs here use stand-ins for ``python3``, the venv's python and ``id`` (not root), so that
they take a second and reach no package index; the checks of this machine's venv read what the real
install left."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.docfiles import ROOT, blocks

from gpushare.sandbox import binaries

VENV = ROOT / ".venv"

#: the machine's python3: logs its arguments, answers ``import ensurepip`` as $FAKE_ENSUREPIP says, and
#: makes a venv whose python is $FAKE_VENV_PYTHON
MACHINE_PYTHON = r"""#!/bin/sh
echo "machine $*" >>"$FAKE_LOG"
case "$*" in
  "-c import ensurepip") exit "$FAKE_ENSUREPIP" ;;
  "-m venv "*) mkdir -p .venv/bin && cp "$FAKE_VENV_PYTHON" .venv/bin/python3 ;;
esac
"""
VENV_PYTHON = """#!/bin/sh
echo "venv $*" >>"$FAKE_LOG"
"""


def install(work: Path, ensurepip: bool = True) -> list[str]:
    """Run install.sh from a copy in ``work`` (with pyproject.toml) as a user who isn't root, with the
    stand-ins first on PATH; return the python calls it made, one ``machine ...`` or ``venv ...`` line each."""
    fakes = work / "fakes"
    fakes.mkdir(exist_ok=True)
    for name, text in (("python3", MACHINE_PYTHON), ("venv-python3", VENV_PYTHON), ("id", "#!/bin/sh\necho 1000\n")):
        (fakes / name).write_text(text)
        (fakes / name).chmod(0o755)
    log = work / "calls"
    log.unlink(missing_ok=True)
    env = {
        **os.environ,
        "PATH": f"{fakes}{os.pathsep}{os.environ['PATH']}",
        "FAKE_LOG": str(log),
        "FAKE_ENSUREPIP": "0" if ensurepip else "1",
        "FAKE_VENV_PYTHON": str(fakes / "venv-python3"),
    }
    done = subprocess.run(["bash", str(work / "install.sh")], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    for name in ("install.sh", "pyproject.toml"):
        shutil.copy2(ROOT / name, tmp_path / name)
    return tmp_path


def pip_installs(calls: list[str]) -> list[str]:
    return [call for call in calls if " -m pip " in f"{call} "]


@pytest.mark.parametrize("ensurepip", [True, False], ids=["with-ensurepip", "without-ensurepip"])
def test_install_puts_gpushare_in_the_checkouts_venv_and_never_in_the_machines_python(
    checkout: Path, ensurepip: bool
) -> None:
    calls = install(checkout, ensurepip)
    made = "machine -m venv --clear .venv" if ensurepip else "machine -m venv --clear --without-pip .venv"
    assert made in calls
    assert "venv -m pip install -q --disable-pip-version-check -e .[test]" in calls
    # the machine's pip, when it runs at all, installs pip into the venv (--python), nothing into itself
    assert all(call.startswith("venv ") or "--python .venv/bin/python3" in call for call in pip_installs(calls))
    assert "venv -m gpushare.sandbox.binaries --link .venv/bin" in calls


def test_a_second_install_reinstalls_nothing_until_pyproject_changes(checkout: Path) -> None:
    install(checkout)
    again = install(checkout)
    assert not [call for call in again if "-m venv" in call] and not pip_installs(again), again
    assert "venv -m gpushare.sandbox.binaries --link .venv/bin" in again  # a cache built since is linked

    with (checkout / "pyproject.toml").open("a") as pyproject:
        pyproject.write("# a new dependency\n")
    assert pip_installs(install(checkout)) == ["venv -m pip install -q --disable-pip-version-check -e .[test]"]


def test_ci_runs_the_readmes_test_command() -> None:
    """Each step of the README's test line is a line of .ci/run, in the same order (CI adds its check
    that nothing will be skipped)."""
    first = blocks(ROOT / "README.md")[0]
    (line,) = [line for line in first.text.splitlines() if line.endswith("# test")]
    steps = [step.strip() for step in line.partition("#")[0].split("&&")]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert all(step in ci for step in steps), f"{steps} not all in .ci/run"
    assert [ci.index(step) for step in steps] == sorted(ci.index(step) for step in steps)
    assert ". .venv/bin/activate" in steps


def in_this_venv() -> bool:
    return Path(sys.prefix).resolve() == VENV.resolve()


def test_the_gpushare_under_test_is_this_checkouts() -> None:
    """Not another checkout's, as when both were installed into one interpreter and the last one won."""
    import gpushare

    where = Path(gpushare.__file__).resolve()
    assert where.is_relative_to(ROOT), f"{sys.executable} imports {where}: run the tests in {VENV} (README)"


@pytest.mark.skipif(not in_this_venv(), reason="not running in this checkout's .venv")
@pytest.mark.parametrize("name", binaries.USER_TOOLS)
def test_the_venv_runs_the_cached_tool(name: str) -> None:
    if (why := binaries.missing((name,))) is not None:
        pytest.skip(why)
    assert (VENV / "bin" / name).resolve() == binaries.built(name).resolve()
