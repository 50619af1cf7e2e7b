"""Run the NVML inventory on the fake libnvidia-ml, in this process or in a child process.

In a child process the library is found the way it is on a node: first on ``LD_LIBRARY_PATH``
(:meth:`FakeNvml.env`). This process started before the library existed, so :func:`load_in_process`
loads it by path instead; pynvml's ``CDLL("libnvidia-ml.so.1")`` then gets the already loaded library,
which matches by its soname. The library reads its machine at each ``nvmlInit``, so one process can
run one machine after another as long as each backend is closed before the next opens.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gpushare.gpus.nvml import NvmlBackend
from gpushare.sandbox import fakenvml

_loaded: list[ctypes.CDLL] = []


def fake_machine(machine: str, workdir: Path) -> fakenvml.FakeNvml:
    """The fake library and ``machine``'s control file in ``workdir``; skips the test without gcc."""
    reason = fakenvml.gcc_missing()
    if reason:
        pytest.skip(f"the fake libnvidia-ml can't be built: {reason}")
    return fakenvml.prepare(machine, workdir)


def load_in_process(fake: fakenvml.FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml

    library = fake.library_dir / fakenvml.LIBRARY
    if pynvml.nvmlLib is not None and Path(pynvml.nvmlLib._name).name != fakenvml.LIBRARY:
        pytest.skip(f"this process already loaded another NVML library ({pynvml.nvmlLib._name})")
    if _loaded and _loaded[0]._name != str(library):
        pytest.skip(f"this process already loaded another variant of the fake library ({_loaded[0]._name})")
    if not _loaded:
        _loaded.append(ctypes.CDLL(str(library)))
    monkeypatch.setenv(fakenvml.ENV_MACHINE, str(fake.machine))
    monkeypatch.setenv(fakenvml.ENV_CONTROL, str(fake.control))
    monkeypatch.setenv(fakenvml.ENV_LIMITS, str(fake.limits_record))


@contextmanager
def nvml_backend(
    machine: str, workdir: Path, monkeypatch: pytest.MonkeyPatch, **options: Any
) -> Iterator[tuple[NvmlBackend, fakenvml.FakeNvml]]:
    """The real NVML backend on ``machine``, closed (and NVML shut down) afterwards."""
    fake = fake_machine(machine, workdir)
    load_in_process(fake, monkeypatch)
    backend = NvmlBackend(**options)
    try:
        yield backend, fake
    finally:
        backend.close()


def described_cards(machine: str) -> list[dict[str, str]]:
    """The cards a machine description presents, key -> value, in NVML index order."""
    cards: list[dict[str, str]] = []
    for raw in fakenvml.machine_file(machine).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line == "gpu":
            cards.append({})
        elif line and cards:
            key, _, value = line.partition(" ")
            cards[-1][key] = value.strip()
    return cards
