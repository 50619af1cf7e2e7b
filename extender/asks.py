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

from gpushare import placement
from gpushare.contract.cardrule import parse_card_rule
from gpushare.contract.errors import ContractError, quoted
from gpushare.contract.gang import Gang, parse_gang
from gpushare.contract.names import ANN_POLICY, RESOURCE_CPU, RESOURCE_MEMORY
from gpushare.contract.nodeselection import PodNodes, parse_pod_nodes
from gpushare.contract.request import PodRequest, annotations_of, effective_request, parse_pod_request, pod_key
from gpushare.contract.units import parse_host_quantity

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
    def host_read(self) -> tuple[int, int] | ContractError:
        return _read(host_request, self.pod)

    @property
    def host(self) -> tuple[int, int]:
        """(CPU milli, memory bytes) as kube-scheduler counts it."""
        return _value(self.host_read)

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


def host_amounts(resources: Mapping[str, Any] | None, where: str) -> tuple[int, int]:
    """(CPU milli, memory bytes) of a requests or allocatable map (``where`` names it); a missing entry
    is 0, and QuantityError names one that is unreadable or beyond
    :data:`~gpushare.contract.units.HOST_LIMIT`."""
    resources = resources or {}
    return (
        parse_host_quantity(resources.get(RESOURCE_CPU, 0), 1000, "millicores", f"{where}.{RESOURCE_CPU}"),
        parse_host_quantity(resources.get(RESOURCE_MEMORY, 0), 1, "bytes", f"{where}.{RESOURCE_MEMORY}"),
    )


def host_request(pod: Mapping[str, Any]) -> tuple[int, int]:
    """The pod's (CPU milli, memory bytes) request as kube-scheduler counts it: per resource, the larger
    of the app containers' sum and the largest init container. QuantityError, naming the pod, container
    and field, for a request that can't be counted."""
    spec, key = pod.get("spec") or {}, pod_key(pod)

    def requests(containers: Any) -> list[tuple[int, int]]:
        return [
            host_amounts(
                (c.get("resources") or {}).get("requests"),
                f"pod {key} container {quoted(c.get('name') or '?')} resources.requests",
            )
            for c in containers or []
        ]

    apps, inits = requests(spec.get("containers")), requests(spec.get("initContainers"))
    return (
        effective_request((a[0] for a in apps), (i[0] for i in inits)),
        effective_request((a[1] for a in apps), (i[1] for i in inits)),
    )
