"""What the extender reads of a pod, read once where the pod comes in: from a verb's body, from the API
server, or from the pod watch. Filter, prioritize, bind and preempt, the cache and the gang planner all
take that one value along rather than reading the pod again.

The value is read from the very pod it describes: anyone can send the extender a pod body with a real
pod's uid and resourceVersion but other limits, so an ask read from a verb's body only ever answers
that call, and bind places a pod by the ask read from the pod as the watch or the API server has it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

from gpushare.extender.podfit import InitOrder
from kubernetes.utils import parse_quantity

from gpushare import placement
from gpushare.contract.cardrule import parse_card_rule
from gpushare.contract.errors import ContractError
from gpushare.contract.gang import Gang, parse_gang
from gpushare.contract.names import ANN_POLICY, RESOURCE_CPU, RESOURCE_MEMORY
from gpushare.contract.nodeselection import PodNodes, parse_pod_nodes
from gpushare.contract.request import PodRequest, annotations_of, effective_request, parse_pod_request, pod_key

T = TypeVar("T")


@dataclass(frozen=True)
class PodAsk:
    """A pod's GPU request with its demands and the order Kubernetes runs them in, its card rule, gang,
    node constraints, CPU and memory request and policy annotation, as read from one version of it.

    The parts every verb reads are read when the ask is made; the node constraints and the CPU and
    memory request, which only some read, on first use (from the same pod, at most once). A part that
    can't be read keeps its ContractError, raised (naming the pod and field) when a verb reads that
    part, so each verb meets the problems it cares about in the order it reads them; a pod without GPUs
    never meets a bad card rule, for instance."""

    key: str
    uid: str
    #: the pod's ``gpushare.io/policy`` annotation, if any (the engine checks the name)
    policy: str | None
    #: each of these: the part, or why it can't be read
    request_read: PodRequest | ContractError
    rule_read: placement.CardRule | ContractError
    gang_read: Gang | ContractError | None
    #: the GPU containers as placement demands, and the groups Kubernetes runs them in
    order_read: InitOrder | ContractError
    #: the pod the ask was read from, for the parts read on first use
    pod: Mapping[str, Any] = field(repr=False, compare=False)

    @cached_property
    def host(self) -> tuple[int, int]:
        """(CPU milli, memory bytes) as kube-scheduler counts it."""
        return host_request(self.pod)

    @cached_property
    def nodes_read(self) -> PodNodes | ContractError:
        return _read(parse_pod_nodes, self.pod)

    @property
    def request(self) -> PodRequest:
        return _value(self.request_read)

    @property
    def order(self) -> InitOrder:
        return _value(self.order_read)

    @property
    def demands(self) -> tuple[placement.Demand, ...]:
        """The GPU containers as placement demands, in spec order."""
        return self.order.demands

    @property
    def rule(self) -> placement.CardRule:
        return _value(self.rule_read)

    @property
    def gang(self) -> Gang | None:
        return _value(self.gang_read)

    @property
    def nodes(self) -> PodNodes:
        return _value(self.nodes_read)


def _value(part: T | ContractError) -> T:
    if isinstance(part, ContractError):
        raise part.with_traceback(None)  # the same error, raised anew without the frames of earlier raises
    return part


def _read(parse: Any, pod: Mapping[str, Any]) -> Any:
    try:
        return parse(pod)
    except ContractError as exc:
        return exc


def read_ask(pod: Mapping[str, Any]) -> PodAsk:
    """Everything the extender reads of ``pod``; never raises for a pod of the API's shape."""
    meta = pod.get("metadata") or {}
    request = _read(parse_pod_request, pod)
    return PodAsk(
        key=pod_key(pod),
        uid=meta.get("uid", ""),
        policy=annotations_of(pod).get(ANN_POLICY),
        request_read=request,
        rule_read=_read(parse_card_rule, pod),
        gang_read=_read(parse_gang, pod),
        order_read=request if isinstance(request, ContractError) else init_order(request),
        pod=pod,
    )


def init_order(request: PodRequest) -> InitOrder:
    """The request's GPU containers as placement demands, grouped as Kubernetes runs them."""
    demands = tuple(
        placement.Demand(
            container=c.name, units=0 if c.exclusive else c.units_per_card, cards=c.cards, exclusive=c.exclusive
        )
        for c in request.gpu_containers
    )
    return InitOrder.of(demands, frozenset(c.name for c in request.containers if c.init))


def host_amounts(resources: Mapping[str, Any] | None) -> tuple[int, int]:
    """(CPU milli, memory bytes) of a requests or allocatable map; a missing or unreadable entry is 0."""
    amounts = []
    for name, scale in ((RESOURCE_CPU, 1000), (RESOURCE_MEMORY, 1)):
        try:
            amounts.append(int(parse_quantity((resources or {}).get(name, 0)) * scale))
        except (ValueError, TypeError, ArithmeticError):
            amounts.append(0)
    return amounts[0], amounts[1]


def host_request(pod: Mapping[str, Any]) -> tuple[int, int]:
    """The pod's (CPU milli, memory bytes) request as kube-scheduler counts it: per resource, the larger
    of the app containers' sum and the largest init container."""
    spec = pod.get("spec") or {}
    apps = [host_amounts((c.get("resources") or {}).get("requests")) for c in spec.get("containers") or []]
    inits = [host_amounts((c.get("resources") or {}).get("requests")) for c in spec.get("initContainers") or []]
    return (
        effective_request((a[0] for a in apps), (i[0] for i in inits)),
        effective_request((a[1] for a in apps), (i[1] for i in inits)),
    )
