"""The ``inspect`` tables: ours (each node in its own unit, with its cards' models, memory limits,
health, over-commitment and notes) and the original ``kubectl-inspect-gpushare``'s columns and totals lines,
for scripts that parse them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from gpushare.contract.units import MemoryUnit
from gpushare.inspection.views import DEVICE_PLUGIN, CardView, ClaimView, ClusterView, NodeView

#: how many pods not bound yet the footer names (a cluster can have thousands)
UNSCHEDULED_NAMED = 10

K = TypeVar("K")


def render_table(rows: list[list[str]], gap: int = 2) -> str:
    """Left-aligned columns, as kubectl prints them."""
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(max(len(r) for r in rows))]
    return "\n".join((" " * gap).join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows)


def quantity(amount: str, unit: MemoryUnit) -> str:
    """``amount`` followed by the unit: ``8/80 GiB``, ``3 MiB``, ``6 x 512MiB``."""
    return f"{amount} {unit.name}" if unit.mib in (1, 1024) else f"{amount} x {unit.name}"


def percent(part: int, whole: int) -> str:
    return f"{part * 100 // whole}%" if whole else "0%"


def _card_cell(card: CardView) -> str:
    """``allocated/total``, then the way the card is offered unless it is the device plugin's, and its troubles."""
    flags = [card.way] if card.way != DEVICE_PLUGIN else []
    flags += [f for f, on in (("unhealthy", not card.healthy), ("over-committed", card.overcommitted)) if on]
    cell = f"{card.allocated}/{card.total}"
    return f"{cell} ({', '.join(flags)})" if flags else cell


def _indexes_by(cards: Iterable[CardView], key: Callable[[CardView], K]) -> dict[K, str]:
    """The cards' ``key``s, each with its cards in index order (``GPU0, GPU1``)."""
    indexes: dict[K, list[int]] = {}
    for card in sorted(cards, key=lambda c: c.index):
        indexes.setdefault(key(card), []).append(card.index)
    return {k: ", ".join(f"GPU{i}" for i in held) for k, held in indexes.items()}


def models(cards: Iterable[CardView]) -> str:
    """The cards' models: the one model when all share it, else each model with its cards in index
    order (``A100-80GB (GPU0, GPU1), T4 (GPU2)``); ``-`` when none is known."""
    by_model = _indexes_by(cards, lambda c: c.model or "unknown")
    if not by_model or set(by_model) == {"unknown"}:
        return "-"
    if len(by_model) == 1:
        return next(iter(by_model))
    return ", ".join(f"{model} ({gpus})" for model, gpus in by_model.items())


def limits(cards: Iterable[CardView], detailed: bool = False) -> str:
    """Whether the driver enforces GPU memory limits on the cards: ``enforced`` or ``off`` when all
    agree, else each with its cards (``enforced (GPU0), off (GPU1)``); ``detailed`` adds why they are
    off (``off: cgroup hybrid (...)``, ``enforced (GPU0); off (GPU1): ...``). ``-`` without cards."""

    def state(card: CardView) -> tuple[str, str]:
        if card.limits_enforced:
            return "enforced", ""
        return "off", card.memory_limits if detailed else ""

    by_state = _indexes_by(cards, state)
    if len(by_state) == 1:
        ((word, cause),) = by_state
        return f"{word}: {cause}" if cause else word
    parts = [f"{word} ({gpus})" + (f": {cause}" if cause else "") for (word, cause), gpus in by_state.items()]
    return ("; " if detailed else ", ").join(parts) or "-"


def _pending_cell(node: NodeView) -> str:
    return (
        f"{node.pending} ({node.pending_pods} pod{'s' if node.pending_pods != 1 else ''})" if node.pending_pods else ""
    )


def _footer(cluster: ClusterView) -> list[str]:
    lines: list[str] = []
    for node in cluster.nodes:
        if node.capacity_note:
            lines.append(f"note: node {node.name}: {node.capacity_note}")
        lines.extend(f"warning: node {node.name}: {problem}" for problem in node.problems)
    lines.extend(f"warning: {problem}" for problem in cluster.problems)
    if cluster.unscheduled:
        lines.append(
            f"{len(cluster.unscheduled)} pod(s) requesting GPUs are not bound to a node yet: "
            + _first(cluster.unscheduled, UNSCHEDULED_NAMED)
        )
    return lines


def _first(names: tuple[str, ...], count: int) -> str:
    """The first ``count`` of ``names``, and how many more there are."""
    shown = ", ".join(names[:count])
    return shown + (f" and {len(names) - count} more" if len(names) > count else "")


def _cluster_total(cluster: ClusterView) -> str:
    allocated, total = cluster.totals()
    return f"Allocated/Total GPU memory in cluster: {quantity(f'{allocated}/{total}', cluster.common_unit)} " + (
        f"({percent(allocated, total)})"
    )


def render_summary(cluster: ClusterView) -> str:
    """One row per node: each card's allocated/total in the node's unit, pending, and the node total."""
    if not cluster.nodes:
        return "\n".join(["no node has gpushare GPUs", *_footer(cluster)])
    # a column per card index any node has (a node whose cards are split between the two ways lacks some)
    indexes = sorted({c.index for n in cluster.nodes for c in n.cards})
    with_pending = any(n.pending_pods for n in cluster.nodes)
    header = ["NAME", "IPADDRESS", "UNIT", *(f"GPU{i}(Allocated/Total)" for i in indexes)]
    header += ["PENDING(Allocated)"] if with_pending else []
    rows = [[*header, "GPU Memory(Allocated/Total)", "MODEL", "LIMITS"]]
    for node in cluster.nodes:
        by_index = {c.index: c for c in node.cards}
        cells = [_card_cell(by_index[i]) if i in by_index else "-" for i in indexes]
        row = [node.name, node.address, node.unit.name, *cells]
        row += [_pending_cell(node)] if with_pending else []
        total = f"{node.allocated}/{node.total} ({percent(node.allocated, node.total)})"
        rows.append([*row, total, models(node.cards), limits(node.cards)])
    table = render_table(rows)
    rule = "-" * max(len(line) for line in table.splitlines())
    return "\n".join([table, rule, _cluster_total(cluster), *_footer(cluster)])


def _claim_name(claim: ClaimView) -> str:
    """A claim's row name in ``-d``, which no pod can have: ``resourceclaim/<name>``."""
    return f"resourceclaim/{claim.name}"


def _node_details(node: NodeView) -> str:
    cards = sorted(node.cards, key=lambda c: c.index)
    with_pending = node.pending_pods > 0
    header = ["NAME", "NAMESPACE", *(f"GPU{c.index}(Allocated)" for c in cards)]
    header += ["PENDING(Allocated)"] if with_pending else []
    rows = [header + (["RESERVED FOR"] if node.claims else [])]
    for pod in node.pods:
        row = [pod.name, pod.namespace, *(str(pod.units.get(c.index, 0)) for c in cards)]
        rows.append(row + ([str(pod.pending) if pod.is_pending else "0"] if with_pending else []))
    for claim in node.claims:
        row = [_claim_name(claim), claim.namespace, *(str(claim.units.get(c.index, 0)) for c in cards)]
        rows.append(row + (["0"] if with_pending else []) + [", ".join(claim.users) or "-"])
    totals = ["Allocated/Total:", "", *(_card_cell(c) for c in cards)]
    rows.append(totals + ([_pending_cell(node)] if with_pending else []))
    lines = [
        f"NAME:       {node.name}",
        f"IPADDRESS:  {node.address}",
        f"UNIT:       {node.unit.name}",
        f"MODEL:      {models(node.cards)}",
        f"LIMITS:     {limits(node.cards, detailed=True)}",
        "",
        render_table(rows),
        "",
        f"Allocated:  {quantity(str(node.allocated), node.unit)} ({percent(node.allocated, node.total)})",
        f"Total:      {quantity(str(node.total), node.unit)}",
    ]
    return "\n".join(lines)


def render_details(cluster: ClusterView) -> str:
    """Per node: every pod with its units on each card, then the node's and the cluster's totals."""
    if not cluster.nodes:
        return render_summary(cluster)
    blocks = [_node_details(node) for node in cluster.nodes]
    rule = "-" * max(len(line) for block in blocks for line in block.splitlines())
    body = f"\n{rule}\n".join(blocks)
    return "\n".join([body, rule, _cluster_total(cluster), *_footer(cluster)])


# --- the original kubectl-inspect-gpushare layout ---------------------------------------------------


def _in_unit(amount: int, node: NodeView, unit: MemoryUnit) -> int:
    return amount * node.unit.mib // unit.mib


def render_original_summary(cluster: ClusterView) -> str:
    """The original's summary: ``GPU<i>(Allocated/Total)`` per card, ``PENDING(Allocated)`` when a
    pod waits for a card, ``GPU Memory(<unit>)`` per node, then a rule and the cluster's totals on the
    two lines the original prints. Nodes with other units than the rest are converted to MiB."""
    unit = cluster.common_unit
    width = max((len(n.cards) for n in cluster.nodes), default=0)
    with_pending = any(n.pending_pods for n in cluster.nodes)
    header = ["NAME", "IPADDRESS", *(f"GPU{i}(Allocated/Total)" for i in range(width))]
    rows = [[*header, *(["PENDING(Allocated)"] if with_pending else []), f"GPU Memory({unit.name})"]]
    used_total = all_total = 0
    for node in cluster.nodes:
        cards = sorted(node.cards, key=lambda c: c.index)
        cells = [f"{_in_unit(c.allocated, node, unit)}/{_in_unit(c.total, node, unit)}" for c in cards]
        used = _in_unit(node.allocated + node.pending, node, unit)
        total = _in_unit(node.total, node, unit)
        row = [node.name, node.address, *cells, *["0/0"] * (width - len(cards))]
        row += [str(_in_unit(node.pending, node, unit)) if node.pending_pods else ""] if with_pending else []
        rows.append([*row, f"{used}/{total}"])
        used_total, all_total = used_total + used, all_total + total
    table = render_table(rows)
    rule = "-" * (max(len(line) for line in table.splitlines()) + 2)
    return "\n".join(
        [
            table,
            rule,
            "Allocated/Total GPU Memory In Cluster:",
            f"{used_total}/{all_total} ({percent(used_total, all_total)})",
        ]
    )


def _original_node_details(node: NodeView, unit: MemoryUnit) -> tuple[str, int, int]:
    cards = sorted(node.cards, key=lambda c: c.index)
    with_pending = node.pending_pods > 0
    rows = [["NAME", "NAMESPACE", *(f"GPU{c.index}(Allocated)" for c in cards)]]
    rows[0] += ["Pending(Allocated)"] if with_pending else []
    for pod in node.pods:
        row = [pod.name, pod.namespace, *(str(_in_unit(pod.units.get(c.index, 0), node, unit)) for c in cards)]
        rows.append(row + ([str(_in_unit(pod.pending or 0, node, unit))] if with_pending else []))
    for claim in node.claims:
        row = [
            _claim_name(claim),
            claim.namespace,
            *(str(_in_unit(claim.units.get(c.index, 0), node, unit)) for c in cards),
        ]
        rows.append(row + (["0"] if with_pending else []))
    used = _in_unit(node.allocated + node.pending, node, unit)
    total = _in_unit(node.total, node, unit)
    text = "\n".join(
        [
            "",
            f"NAME:       {node.name}",
            f"IPADDRESS:  {node.address}",
            "",
            render_table(rows),
            f"Allocated :  {used} ({percent(used, total)})",
            f"Total :      {total}",
        ]
    )
    return text, used, total


def render_original_details(cluster: ClusterView) -> str:
    """The original's ``-d`` layout: per node its pods' allocation per card, then ``Allocated :`` and
    ``Total :``, a rule, and at the end the cluster's ``Allocated/Total GPU Memory In Cluster:`` line."""
    unit = cluster.common_unit
    blocks = [_original_node_details(node, unit) for node in cluster.nodes]
    rule = "-" * max((len(line) for text, _, _ in blocks for line in text.splitlines()), default=40)
    used = sum(u for _, u, _ in blocks)
    total = sum(t for _, _, t in blocks)
    lines = [f"{text}\n{rule}" for text, _, _ in blocks]
    lines += ["", "", f"Allocated/Total GPU Memory In Cluster:  {used}/{total} ({percent(used, total)})"]
    return "\n".join(lines)
