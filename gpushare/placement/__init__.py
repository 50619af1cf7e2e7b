"""Pure placement: which node and card(s) a pod's GPU demands take, under a choice of policies.

No I/O here; the extender and the trace-replay benchmark both drive these functions.
"""

from gpushare.placement.batch import BatchChoice, batch_place, batch_scores
from gpushare.placement.fit import SEARCH_BUDGET, check_fit, node_cost, place
from gpushare.placement.fragmentation import Workload, fragmentation
from gpushare.placement.model import Assignment, Card, Demand, NoFit, Shape, shape_key
from gpushare.placement.policies import DEFAULT_POLICY, POLICIES, Binpack, Fgd, HostFit, Policy, Spread

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "SEARCH_BUDGET",
    "Assignment",
    "BatchChoice",
    "Binpack",
    "Card",
    "Demand",
    "Fgd",
    "HostFit",
    "NoFit",
    "Policy",
    "Shape",
    "Spread",
    "Workload",
    "batch_place",
    "batch_scores",
    "check_fit",
    "fragmentation",
    "node_cost",
    "place",
    "shape_key",
]
