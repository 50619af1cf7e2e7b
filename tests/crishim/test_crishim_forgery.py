"""A tenant's pod can write its own annotations and env, not what kubelet puts in the container config:
the CRI shim decides GPU-ness from the latter, and never decides over-commit from nothing."""

from __future__ import annotations

from typing import Any

from gpushare.crishim.edge import container_of
from support.cri import env_of, plain_config, plugin_config, request_for, rewrite_config
from support.crishim import A0, A1, CARDS, POD, FakePods, allocation_of, pod_dict, slice_of

from gpushare.contract.names import ANN_MEM_IDX, ENV_MEM_CONTAINER, ENV_MEM_IDX, ENV_VISIBLE_DEVICES
from gpushare.contract.pending import PendingBind
from gpushare.contract.units import GIB
from gpushare.enforcement.container import Target
from gpushare.enforcement.resolve import CachedPods, Resolver
from gpushare.settings import RewriteOptions

SIDECAR = Target(POD.namespace, POD.pod, POD.uid, "sidecar")


def decide(resolver: Resolver, annotations: dict[str, str], config: Any) -> tuple[Any, Any]:
    request = request_for(SIDECAR, annotations, config)
    found = resolver.resolve(container_of(request), CARDS)
    return found, rewrite_config(request.config, found, CARDS, GIB, RewriteOptions())


def no_gpu_pod() -> dict[str, Any]:
    """The sidecar's pod from the API: it requests no GPU at all."""
    pod = pod_dict("train", "uid-train", None)
    pod["spec"]["containers"] = [{"name": "sidecar"}]
    return pod


def test_a_forged_allocation_gives_no_card_to_a_container_kubelet_served_nothing() -> None:
    forged = allocation_of(sidecar=(slice_of(A0),))
    found, outcome = decide(Resolver(GIB, FakePods([no_gpu_pod()])), forged, plain_config())
    assert not found.wants_gpu
    assert env_of(outcome.config)[ENV_VISIBLE_DEVICES] == ["void"]


def test_forged_original_keys_and_env_give_no_card() -> None:
    """ALIYUN_COM_GPU_MEM_IDX on the pod plus the plugin's env set in the pod spec."""
    spec_env = plain_config((ENV_MEM_CONTAINER, "80"), (ENV_MEM_IDX, "0"), (ENV_VISIBLE_DEVICES, A0.uuid))
    found, outcome = decide(Resolver(GIB, FakePods([no_gpu_pod()])), {ANN_MEM_IDX: "0"}, spec_env)
    assert not found.wants_gpu
    assert env_of(outcome.config)[ENV_VISIBLE_DEVICES] == ["void"]
    # without the API to ask, such a container is refused, never given the card
    found, outcome = decide(Resolver(GIB, FakePods([], fail=True)), {ANN_MEM_IDX: "0"}, spec_env)
    assert outcome.refusal is not None and found.refusal.reason == "api-unavailable"


def test_the_capacity_check_fails_closed_before_the_pods_were_ever_listed() -> None:
    mine = {"worker": (slice_of(A0, 30),)}
    pods = FakePods([pod_dict("train", "uid-train", mine, mem=30)], synced=False)
    request = request_for(POD, allocation_of(**mine), plugin_config(POD, [slice_of(A0, 30)], pod_mem=30))
    found = Resolver(GIB, pods).resolve(container_of(request), CARDS)
    assert found.refusal is not None and found.refusal.reason == "api-unavailable"


class DisconnectedCache:
    """A node pod cache that synced once and then lost the API server."""

    synced = True
    connected = False

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self._pods = pods

    def items(self) -> list[dict[str, Any]]:
        return self._pods

    def get(self, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        return next((p for p in self._pods if p["metadata"]["name"] == name), None)


def test_while_the_api_server_is_down_over_commit_is_judged_from_the_last_synced_pods() -> None:
    others = [pod_dict(f"p{i}", f"uid-{i}", {"worker": (slice_of(A0, 30),)}, mem=30) for i in range(2)]
    mine = {"worker": (slice_of(A0, 30),)}
    cache = DisconnectedCache([*others, pod_dict("train", "uid-train", mine, mem=30)])
    request = request_for(POD, allocation_of(**mine), plugin_config(POD, [slice_of(A0, 30)], pod_mem=30))
    found = Resolver(GIB, CachedPods(None, cache, "node-a")).resolve(container_of(request), CARDS)
    assert found.refusal is not None and found.refusal.reason == "overcommit"


def test_the_shim_refuses_a_container_whose_annotation_disagrees_with_the_ledger() -> None:
    """The pod moved its allocation to card 0 after binding; the extender recorded card 1 on the node."""
    moved = {"worker": (slice_of(A0, 20),)}
    pods = FakePods([pod_dict("train", "uid-train", moved)])
    pods.recorded = {"uid-train": PendingBind("default/train", {A1.uuid: 20}, 0.0)}
    request = request_for(POD, allocation_of(**moved), plugin_config(POD, [slice_of(A0, 20)]))
    found = Resolver(GIB, pods).resolve(container_of(request), CARDS)
    assert found.refusal is not None and found.refusal.reason == "ledger-mismatch"
    assert f"recorded card 1 ({A1.uuid}) 20 unit(s)" in found.refusal.message
    pods.recorded = {"uid-train": PendingBind("default/train", {A0.uuid: 20}, 0.0)}
    assert Resolver(GIB, pods).resolve(container_of(request), CARDS).refusal is None
