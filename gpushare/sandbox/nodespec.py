"""The simulated nodes ``gpushare sandbox`` runs, parsed from its flags before anything starts."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gpushare.gpus.backend import InventoryError
from gpushare.gpus.simulated import parse_sim_spec, simulated_cards
from gpushare.gpus.split import check_dra_cards, parse_dra_cards

DEFAULT_NODES = ("node-a=2xA100-80GB:81920,1xT4:15360", "node-b=1xA100-40GB:40960,2xA10:24576")
#: a node's sockets sit in a directory named after it, and unix socket paths end at 107 bytes
MAX_NODE_NAME = 20
#: each node on the real cluster gets a /24 of its own (see :func:`gpushare.sandbox.podnetwork.pod_subnet`)
MAX_NODES = 256
_NODE_NAME = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?")


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    gpus: str


def parse_node(text: str) -> NodeSpec:
    """``NAME=COUNTxMODEL:MiB[,...]`` (an argparse type: a bad value is refused before anything starts)."""
    name, sep, gpus = text.partition("=")
    if not sep or not name or not gpus:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=COUNTxMODEL:MiB[,...]")
    if not _NODE_NAME.fullmatch(name) or len(name) > MAX_NODE_NAME:
        raise argparse.ArgumentTypeError(
            f"{text!r}: node name {name!r} is not a lowercase DNS name (a-z, 0-9, '-', '.') "
            f"of at most {MAX_NODE_NAME} characters"
        )
    try:
        parse_sim_spec(gpus)
    except InventoryError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return NodeSpec(name, gpus)


@dataclass(frozen=True, slots=True)
class DraNode:
    """``--dra-cards NODE=CARDS``: the node whose agent also serves the DRA driver, and its ``--dra-cards``."""

    name: str
    cards: str


def parse_dra_node(text: str) -> DraNode:
    """``NODE=CARDS``, CARDS as the node agent's ``--dra-cards`` takes it (an argparse type)."""
    name, sep, cards = text.partition("=")
    if not sep or not name or not cards:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NODE=CARDS (CARDS: all, or card indexes separated by commas)"
        )
    try:
        parse_dra_cards(cards)
    except InventoryError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return DraNode(name, cards)


def check_dra_nodes(dra: Sequence[DraNode], specs: Sequence[NodeSpec], names: Sequence[str]) -> str | None:
    """None when each ``--dra-cards`` names one of the sandbox's nodes ``names`` once, and, on a simulated
    node (``specs``), only cards it has; else why not. A fake-NVML node's agent checks its cards itself."""
    gpus = {s.name: s.gpus for s in specs}
    seen: set[str] = set()
    for node in dra:
        if node.name not in names:
            return f"--dra-cards {node.name}={node.cards}: no node {node.name!r} (nodes: {', '.join(names)})"
        if node.name in seen:
            return f"--dra-cards names node {node.name!r} twice"
        seen.add(node.name)
        if node.name in gpus:
            try:
                check_dra_cards(parse_dra_cards(node.cards), simulated_cards(node.name, gpus[node.name]))
            except InventoryError as exc:
                return f"node {node.name!r}: {exc}"
    return None


def check_node_names(names: Sequence[str]) -> str | None:
    """None when the nodes can run side by side, else why not."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return f"two nodes are named {name!r}"
        seen.add(name)
    if len(names) > MAX_NODES:
        return f"{len(names)} nodes: at most {MAX_NODES} run on one machine"
    return None
