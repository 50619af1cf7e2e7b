"""The one choice of how filter decides which nodes a pod fits on (:func:`filter_way`), made from the pod's
ask alone."""

from __future__ import annotations

from enum import Enum

from gpushare.extender.asks import PodAsk
from gpushare.extender.podfit import original_plugin_refusal

from gpushare.contract.errors import ContractError


class Way(Enum):
    """How filter decides which nodes a pod fits on."""

    EVERY_NODE = "no GPU demand: every node passes"
    GANG = "a gang member: the gang planner"
    MATRIX = "one shared single-card demand: the node matrix, on every kind of node"
    MATRIX_KNOWN_CARDS = "one demand: the node matrix where the node's cards are known, each other node on its own"
    EACH_NODE = "each node on its own, by the pod's init order"


def filter_way(ask: PodAsk, places_gangs: bool) -> Way:
    """The one way filter decides for the pod; ContractError (naming the pod) when its request, CPU and
    memory request, card rule or gang can't be read, or it is a gang member and this extender places no
    gangs (``places_gangs``). A pod whose CPU or memory request can't be counted is refused even without
    GPUs: no policy or gang plan could weigh it."""
    _ = ask.host
    demands = ask.demands
    if not demands:
        return Way.EVERY_NODE
    rule, gang = ask.rule, ask.gang
    if gang is not None:
        if not places_gangs:
            raise ContractError(f"pod {ask.key} is in gang {gang.name}, and this extender places no gangs")
        return Way.GANG
    if len(demands) > 1 or (rule.topology and demands[0].cards > 1):
        return Way.EACH_NODE  # the node matrix knows one demand, and no topology
    if original_plugin_refusal(demands) is None:
        return Way.MATRIX
    return Way.MATRIX_KNOWN_CARDS
