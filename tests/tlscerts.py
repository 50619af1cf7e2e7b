"""Throw-away certificates for TLS tests (see :mod:`gpushare.sandbox.certs`); skipped without openssl."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gpushare.sandbox.certs import Certs, Pair
from gpushare.sandbox.certs import make_certs as _make_certs

__all__ = ["Certs", "Pair", "make_certs"]


def make_certs(directory: Path, server_names: tuple[str, ...] = ("localhost",)) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    return _make_certs(directory, server_names)
