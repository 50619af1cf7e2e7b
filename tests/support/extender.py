"""Clusters with a running extender for the tests of tests/extender (their fixtures are in its
conftest.py), and how a test reads what the extender answered and recorded."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpushare.advertiser.agent import Advertiser
from gpushare.deviceplugin.wiring import start_device_plugin
from gpushare.extender.wiring import RunningExtender, start_extender
from kubernetes import client

from gpushare.contract.allocation import parse_allocation
from gpushare.contract.names import ANN_ALLOCATION, RESOURCE_COUNT, RESOURCE_MEM
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import SimulatedBackend
from gpushare.kube.objects import get_pod
from gpushare.sandbox.kubeletemulator import KubeletEmulator
from gpushare.sandbox.scheduler import ExtenderClient, ScheduleResult, schedule_one
from gpushare.settings import NodeSettings

from .waiting import wait_until

NODES = {"n1": "2xA100-80GB:81920,1xT4:15360", "n2": "1xA10:24576"}


class Cluster:
    """The nodes of ``NODES`` with published inventories, and one extender reached over HTTP."""

    def __init__(self, api: client.ApiClient, core: client.CoreV1Api, policy: str = "binpack") -> None:
        self.api, self.core = api, core
        self.backends = {}
        for name, spec in NODES.items():
            core.create_node({"metadata": {"name": name}})
            self.backends[name] = SimulatedBackend(name, spec)
            Advertiser(api, name, self.backends[name], GIB).publish_once()
        self.extender: RunningExtender = start_extender(api, 0, policy, host="127.0.0.1")
        assert self.extender.cache.wait_synced(5)
        wait_until(lambda: all(self.extender.cache.view(n) for n in NODES), what="the inventories in the cache")
        self.url = f"http://127.0.0.1:{self.extender.server.port}"

    @classmethod
    def beside(cls, cluster: Cluster, extender: RunningExtender) -> Cluster:
        """The same cluster through another extender replica."""
        other = cls.__new__(cls)
        other.api, other.core, other.backends, other.extender = cluster.api, cluster.core, cluster.backends, extender
        other.url = f"http://127.0.0.1:{extender.server.port}"
        return other

    def post(self, verb: str, body: Any, raw: bytes | None = None) -> Any:
        data = raw if raw is not None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}/{verb}", data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            return json.loads(reply.read())

    def pod(self, pod: dict) -> dict:
        """Create ``pod`` unbound and return it as the scheduler would send it (a full v1.Pod)."""
        pod = {**pod, "spec": {k: v for k, v in pod["spec"].items() if k != "nodeName"}}
        created = self.core.create_namespaced_pod("default", pod)
        return self.api.sanitize_for_serialization(created)

    def filter(self, pod: dict, names=tuple(NODES)) -> dict:
        return self.post("filter", {"Pod": pod, "NodeNames": list(names)})

    def bind(self, pod: dict, node: str) -> dict:
        meta = pod["metadata"]
        return self.post(
            "bind", {"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": node}
        )

    def allocation(self, name: str) -> dict:
        ann = self.core.read_namespaced_pod(name, "default").metadata.annotations or {}
        return parse_allocation(ann[ANN_ALLOCATION]) if ANN_ALLOCATION in ann else {}


ADMITTING_NODES = {"gpu-a": "2xA100-80GB:81920,1xT4:15360", "gpu-b": "1xA10:24576"}


class AdmittingCluster:
    """Each node with an advertiser, a kubelet emulator and the real device plugin; one extender that
    kube-scheduler's calls go to. ``stop`` stops them all, and so does a failed start."""

    def __init__(
        self,
        api: client.ApiClient,
        core: client.CoreV1Api,
        kubeconfig: Path,
        tmp: Path,
        nodes: dict[str, str] = ADMITTING_NODES,
    ) -> None:
        self.api, self.core, self.nodes = api, core, nodes
        self.kubelets: dict[str, KubeletEmulator] = {}
        self.stops: list[Callable[[], None]] = []
        try:
            self._start(kubeconfig, tmp)
        except BaseException:
            self.stop()
            raise

    def _start(self, kubeconfig: Path, tmp: Path) -> None:
        for name, spec in self.nodes.items():
            self.core.create_node({"metadata": {"name": name}})
            backend = SimulatedBackend(name, spec)
            advertiser = Advertiser(self.api, name, backend, GIB, interval=3600)
            advertiser.start()
            self.stops.append(advertiser.stop)
            assert advertiser.published.wait(5)
            kubelet = KubeletEmulator(tmp / name)
            kubelet.start()
            self.stops.append(kubelet.stop)
            settings = NodeSettings(name, str(kubeconfig), f"sim:{spec}", tmp / name, GIB, frozenset())
            plugin = start_device_plugin(settings, backend, self.api)
            self.stops.insert(0, plugin.stop)
            assert kubelet.wait_for(lambda k: k.registered(RESOURCE_MEM) and k.registered(RESOURCE_COUNT), 10)
            self.kubelets[name] = kubelet
        extender = start_extender(self.api, 0, "fgd", host="127.0.0.1")
        self.stops.insert(0, extender.stop)
        assert extender.cache.wait_synced(5)
        wait_until(lambda: all(extender.cache.view(n) for n in self.nodes), what="the advertised inventories")
        self.scheduler = ExtenderClient(f"http://127.0.0.1:{extender.server.port}")

    def stop(self) -> None:
        for stop in self.stops:
            stop()

    def schedule(self, pod: dict) -> ScheduleResult:
        """Create ``pod`` unbound and make kube-scheduler's calls to the extender for it."""
        pod = {**pod, "spec": {k: v for k, v in pod["spec"].items() if k != "nodeName"}}
        self.core.create_namespaced_pod("default", pod)
        pending = get_pod(self.api, "default", pod["metadata"]["name"])
        return schedule_one(self.scheduler, pending, sorted(self.nodes))

    def run(self, pod: dict) -> tuple[dict, dict[str, dict[str, str]]]:
        """Schedule ``pod`` as kube-scheduler would, then admit it on its node; the bound pod and each
        container's env from Allocate."""
        result = self.schedule(pod)
        assert result.node, result.reason
        bound = get_pod(self.api, "default", pod["metadata"]["name"])
        admission = self.kubelets[result.node].admit(bound)
        assert admission.admitted, admission.error
        return bound, {name: out.envs for name, out in admission.containers.items()}


def pod_events(cluster: Cluster, pod: dict) -> list[tuple[str, str]]:
    """(reason, message) of the Events on ``pod``, oldest first."""
    listed = cluster.core.list_namespaced_event("default").items
    mine = [e for e in listed if e.involved_object.uid == pod["metadata"]["uid"]]
    return [(e.reason, e.message) for e in sorted(mine, key=lambda e: e.last_timestamp)]


def host_scores(reply: list[dict[str, Any]], names: Sequence[str]) -> dict[str, int]:
    """A prioritize reply (a HostPriorityList) as kube-scheduler counts it: every node of ``names``, a
    node the reply leaves out scoring 0; each entry a node asked about, once, with a score of 0..10."""
    hosts = [entry["Host"] for entry in reply]
    assert len(set(hosts)) == len(hosts) and set(hosts) <= set(names), hosts
    assert all(set(entry) == {"Host", "Score"} and isinstance(entry["Score"], int) for entry in reply)
    assert all(1 <= entry["Score"] <= 10 for entry in reply), reply
    return dict.fromkeys(names, 0) | {entry["Host"]: entry["Score"] for entry in reply}
