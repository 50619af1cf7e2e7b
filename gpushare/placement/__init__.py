"""Pure placement: which node and card(s) a pod's GPU demands take, under a choice of policies.

No I/O here; the extender and the trace-replay benchmark both drive these functions.
"""

from gpushare.placement.batch import (
    BatchChoice,
    able_cards,
    batch_costs,
    batch_place,
    batch_scores,
    fits,
    node_order,
)
from gpushare.placement.demand import (
    ANY_CARD,
    Assignment,
    CardCapacity,
    CardRule,
    Demand,
    NoFit,
    Shape,
    model_matches,
    shape_key,
)
from gpushare.placement.fit import SEARCH_BUDGET, check_fit, node_cost, place
from gpushare.placement.fragmentation import Workload, fragmentation
from gpushare.placement.memo import CostMemo
from gpushare.placement.policies import (
    DEFAULT_POLICY,
    POLICIES,
    Binpack,
    Fgd,
    FgdFit,
    HostFit,
    NodeHosts,
    Policy,
    Spread,
    host_fit,
)

__all__ = [
    "ANY_CARD",
    "DEFAULT_POLICY",
    "POLICIES",
    "SEARCH_BUDGET",
    "Assignment",
    "BatchChoice",
    "Binpack",
    "CardCapacity",
    "CardRule",
    "CostMemo",
    "Demand",
    "Fgd",
    "FgdFit",
    "HostFit",
    "NoFit",
    "NodeHosts",
    "Policy",
    "Shape",
    "Spread",
    "Workload",
    "able_cards",
    "batch_costs",
    "batch_place",
    "batch_scores",
    "check_fit",
    "fits",
    "fragmentation",
    "host_fit",
    "model_matches",
    "node_cost",
    "node_order",
    "place",
    "shape_key",
]
