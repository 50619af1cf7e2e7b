"""docs/operations.md keeps up with the product: it names every Prometheus metric the components
register, and its flag tables list every flag (with its default) of each command run on a cluster."""

from __future__ import annotations

import argparse
import importlib
import re
import tomllib

import pytest
from gpushare.extender.metrics import CARD_GAUGES
from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, REGISTRY
from support.docfiles import OPERATIONS, ROOT, section

#: the commands whose flags docs/operations.md lists, each under the heading "`gpushare COMMAND`"
TABLED = ("node", "device-plugin", "cri-shim", "advertiser", "extender", "kube-scheduler", "webhook", "inspect")
#: commands documented elsewhere, for contributors or for what-if replays, not run on a cluster
ELSEWHERE = {"sandbox": "CONTRIBUTING.md", "apiserver": "CONTRIBUTING.md", "simulate": "docs/placement.md"}


# --- metrics --------------------------------------------------------------------------------------


def metric_modules() -> list[str]:
    """Every product module that uses prometheus_client, by its import name (as pyproject maps the
    component folders into the gpushare package)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = []
    for package, folder in setuptools["package-dir"].items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT / folder)
            if "pb" in relative.parts[:1] or "prometheus_client" not in path.read_text():
                continue
            parts = [p for p in relative.with_suffix("").parts if p != "__init__"]
            found.append(".".join([package, *parts]))
    return found


def registered_metrics() -> set[str]:
    """The metric names the product registers, as /metrics exposes them (counters with ``_total``), and
    the extender's per-card gauges, whose text it keeps itself."""
    for module in metric_modules():
        importlib.import_module(module)
    defaults = {m.name for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR) for m in c.collect()}
    registered = {
        f"{m.name}_total" if m.type == "counter" else m.name for m in REGISTRY.collect() if m.name not in defaults
    }
    return registered | {name for name, _ in CARD_GAUGES}


def documented_metrics() -> set[str]:
    table = section(OPERATIONS, "Metrics")
    return set(re.findall(r"^\| `([a-z_:][a-z0-9_:]*)` \|", table, flags=re.M))


def test_the_product_registers_metrics_from_its_modules() -> None:
    assert metric_modules(), "no product module imports prometheus_client"
    assert registered_metrics()


def test_every_registered_metric_is_in_the_operations_metrics_table() -> None:
    missing = sorted(registered_metrics() - documented_metrics())
    assert not missing, f"docs/operations.md, section Metrics, lacks the metric(s): {', '.join(missing)}"


def test_the_metrics_table_names_only_metrics_that_exist() -> None:
    stale = sorted(documented_metrics() - registered_metrics())
    assert not stale, f"docs/operations.md, section Metrics, names metric(s) nothing registers: {', '.join(stale)}"


# --- flags ----------------------------------------------------------------------------------------


@pytest.fixture
def subcommands(monkeypatch: pytest.MonkeyPatch) -> dict[str, argparse.ArgumentParser]:
    monkeypatch.delenv("NODE_NAME", raising=False)  # --node-name's default comes from it
    from gpushare.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def flag_table(command: str) -> dict[str, str]:
    """Each flag of the table under "`gpushare COMMAND`" in docs/operations.md, with its default cell."""
    rows = {}
    for line in section(OPERATIONS, f"`gpushare {command}`").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2:
            for flag in re.findall(r"`(-[-\w]+)`", cells[0]):
                rows[flag] = cells[1]
    return rows


def shown_default(action: argparse.Action) -> list[str] | None:
    """How the default of ``action`` may be written, or None when it has none worth checking."""
    default = action.default
    if default is None or default is argparse.SUPPRESS or isinstance(default, bool) or default in ("", []):
        return None
    if isinstance(default, float):
        return [f"{default:g}", str(default)]
    return [str(default)]


def test_every_command_has_a_flag_table_or_a_home_elsewhere(subcommands: dict[str, argparse.ArgumentParser]) -> None:
    homeless = sorted(set(subcommands) - set(TABLED) - set(ELSEWHERE))
    assert not homeless, f"docs/operations.md, section Flags, has no table for: gpushare {', gpushare '.join(homeless)}"


@pytest.mark.parametrize("command", TABLED)
def test_the_flag_table_lists_every_flag_with_its_default(
    command: str, subcommands: dict[str, argparse.ArgumentParser]
) -> None:
    assert command in subcommands, f"gpushare has no command {command!r} any more; update docs/operations.md"
    table = flag_table(command)
    parser_flags = {}
    for action in subcommands[command]._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                parser_flags[flag] = action
    missing = sorted(set(parser_flags) - set(table))
    assert not missing, f"docs/operations.md, `gpushare {command}`: the table lacks {', '.join(missing)}"
    stale = sorted(set(table) - set(parser_flags))
    assert not stale, (
        f"docs/operations.md, `gpushare {command}`: the table lists {', '.join(stale)}, which it doesn't take"
    )
    wrong = [
        f"{flag} (default {action.default!r}, the table says {table[flag]!r})"
        for flag, action in parser_flags.items()
        if (shown := shown_default(action)) and not any(text in table[flag] for text in shown)
    ]
    assert not wrong, f"docs/operations.md, `gpushare {command}`: wrong default for {'; '.join(wrong)}"


def test_the_flags_section_names_the_global_flags() -> None:
    from gpushare.cli import build_parser

    text = section(OPERATIONS, "Flags")
    flags = [f for a in build_parser()._actions for f in a.option_strings if f not in ("-h", "--help")]
    missing = [f for f in flags if f"`{f}" not in text and f" {f} " not in text]
    assert not missing, f"docs/operations.md, section Flags, doesn't name gpushare's {', '.join(missing)}"
