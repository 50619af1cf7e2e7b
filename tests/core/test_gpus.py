"""Card inventory: simulated cards are deterministic, health events flow, NVML fails cleanly."""

import subprocess
import sys

import pytest

from gpushare.gpus import open_backend
from gpushare.gpus.backend import DEFAULT_IGNORED_XIDS, HealthEvent, InventoryError, parse_ignored_xids
from gpushare.gpus.simulated import SimulatedBackend, simulated_cards

SPEC = "2xA100-80GB:81920,1xT4:15360"


def test_simulated_cards_are_deterministic_and_differ_per_node() -> None:
    a, b = simulated_cards("n1", SPEC), simulated_cards("n1", SPEC)
    assert a == b
    assert {c.uuid for c in a}.isdisjoint(c.uuid for c in simulated_cards("n2", SPEC))
    assert [(c.model, c.memory_mib) for c in a] == [("A100-80GB", 81920), ("A100-80GB", 81920), ("T4", 15360)]
    for card in a:
        head, _, rest = card.uuid.partition("-")
        assert head == "GPU" and len(rest) == 36 and rest.count("-") == 4


def test_minor_numbers_are_not_the_index() -> None:
    cards = simulated_cards("n1", SPEC)
    assert [c.minor for c in cards] == [2, 1, 0]


def test_nvlink_and_numa_topology() -> None:
    a0, a1, t4 = simulated_cards("n1", SPEC)
    assert a0.nvlink_peers == (a1.uuid,) and a1.nvlink_peers == (a0.uuid,)
    assert t4.nvlink_peers == () and (a0.numa_node, t4.numa_node) == (0, 1)


@pytest.mark.parametrize("spec", ["2A100:1", "0xT4:15360", "2xT4", "2xT4:abc", ""])
def test_bad_sim_spec_is_one_clear_error(spec) -> None:
    with pytest.raises(InventoryError, match="COUNTxMODEL:MiB"):
        simulated_cards("n1", spec)


def test_health_flips_both_ways_and_ignored_xids_change_nothing() -> None:
    backend = SimulatedBackend("n1", SPEC)
    seen: list[HealthEvent] = []
    backend.subscribe(seen.append)
    uuid = backend.cards()[1].uuid
    assert 13 in DEFAULT_IGNORED_XIDS
    assert backend.inject_xid(uuid, 13) is False
    assert all(c.healthy for c in backend.cards()) and seen == []
    assert backend.inject_xid(uuid, 79) is True
    assert [c.healthy for c in backend.cards()] == [True, False, True]
    backend.recover(uuid)
    assert all(c.healthy for c in backend.cards())
    assert [(e.uuid, e.healthy) for e in seen] == [(uuid, False), (uuid, True)]
    assert seen[0].reason == "XID 79"


def test_unknown_card_is_named() -> None:
    with pytest.raises(InventoryError, match="GPU-nope is not on this node"):
        SimulatedBackend("n1", SPEC).inject_xid("GPU-nope", 79)


def test_ignored_xids_flag() -> None:
    assert parse_ignored_xids("13, 31") == frozenset({13, 31})
    assert parse_ignored_xids("") == frozenset()
    with pytest.raises(InventoryError, match="--ignore-xids"):
        parse_ignored_xids("13,x")


def test_unknown_backend() -> None:
    with pytest.raises(InventoryError, match="neither 'nvml' nor 'sim:SPEC'"):
        open_backend("cuda", "n1")


def test_nvml_without_gpu_fails_with_one_sentence() -> None:
    """No driver here: the CLI prints one line naming the way out, not a traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpushare.cli",
            "device-plugin",
            "--node-name",
            "n1",
            "--gpus",
            "nvml",
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("gpushare device-plugin: ") and "--gpus sim:SPEC" in lines[-1]
    assert "Traceback" not in proc.stderr
