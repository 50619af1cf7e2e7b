"""Every manifest in deploy/ is valid for Kubernetes 1.30, grants only what each component needs, and
wires the pieces together (service accounts, ports, probes, mounts, the scheduler's extender entry)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml

from gpushare.cli import build_parser
from gpushare.contract.names import ENV_NODE_NAME, ENV_VISIBLE_DEVICES, RESOURCE_MEM, RESOURCES
from gpushare.contract.request import parse_pod_request
from gpushare.gpus.simulated import simulated_cards
from gpushare.sandbox.image import IMAGE
from gpushare.sandbox.nodespec import DEFAULT_NODES, parse_node

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES_VERSION = "1.30"
#: kinds only newer releases serve (deploy/scheduler.yaml's policy), with the release they are validated for
NEWER_KINDS = {"MutatingAdmissionPolicy": "1.37", "MutatingAdmissionPolicyBinding": "1.37"}
SCHEDULER_CONFIG = DEPLOY / "scheduler-config.yaml"
#: not a Kubernetes API object: kubernetes-validate has no schema for it, so it is checked by hand below
SCHEDULER_CONFIG_KIND = "KubeSchedulerConfiguration"

MANIFESTS = sorted([*DEPLOY.glob("*.yaml"), *DEPLOY.glob("examples/*.yaml")])


def core_grants(resource: str, *verbs: str) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of each of ``verbs`` on a core-group ``resource``."""
    return {("", resource, verb) for verb in verbs}


NODE_AGENT_GRANTS = {
    *core_grants("pods", "get", "list", "watch", "patch"),
    *core_grants("nodes", "get", "patch"),
    *core_grants("events", "create", "patch"),
    *{("resource.k8s.io", "resourceslices", verb) for verb in ("get", "list", "watch", "create", "update")},
    ("resource.k8s.io", "resourceclaims", "get"),
}
EXTENDER_GRANTS = {
    *core_grants("pods", "get", "list", "watch", "patch"),
    *core_grants("pods/binding", "create"),
    *core_grants("nodes", "get", "list", "watch", "patch"),  # patch: the bind's compare-and-swap on the node
    *core_grants("events", "create", "patch"),
    # the original gpushare's fenced cards, only in kube-system
    *core_grants("configmaps", "get", "list", "watch"),
    # the DRA driver's cards and the claims on them, to steer DRA pods' nodes
    *{
        ("resource.k8s.io", resource, verb)
        for resource in ("resourceslices", "resourceclaims")
        for verb in ("list", "watch")
    },
}


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_objects() -> list[dict[str, Any]]:
    return [d for path in MANIFESTS for d in documents(path) if d.get("kind") != SCHEDULER_CONFIG_KIND]


def one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in all_objects() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected exactly one {kind} {name} in deploy/, found {len(found)}"
    return found[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def test_manifests_are_found() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in MANIFESTS}
    assert {"namespace.yaml", "rbac.yaml", "node-agent.yaml", "extender.yaml"} <= names
    assert len([n for n in names if n.startswith("examples/")]) >= 6


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_manifest_is_valid_for_kubernetes(path: Path) -> None:
    docs = documents(path)
    assert docs, f"{path} holds no object"
    for doc in docs:
        if doc.get("kind") == SCHEDULER_CONFIG_KIND:
            continue
        try:
            kubernetes_validate.validate(doc, NEWER_KINDS.get(doc["kind"], KUBERNETES_VERSION), strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata'].get('name')}: {exc.message} at {list(exc.path)}")


def test_the_validator_rejects_an_unknown_field() -> None:
    """Strict mode is what catches a misspelt field; make sure it is in force."""
    pod = documents(DEPLOY / "examples" / "shared-1.yaml")[0]
    pod["spec"]["containers"][0]["resource"] = pod["spec"]["containers"][0].pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


# --- RBAC ------------------------------------------------------------------------------------------


def grants_of(service_account: str, namespace: str) -> set[tuple[str, str, str]]:
    objects = all_objects()
    roles = {d["metadata"]["name"]: d for d in objects if d["kind"] in ("ClusterRole", "Role")}
    granted: set[tuple[str, str, str]] = set()
    for binding in (d for d in objects if d["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        subjects = binding.get("subjects") or []
        if not any(
            s["kind"] == "ServiceAccount" and s["name"] == service_account and s.get("namespace") == namespace
            for s in subjects
        ):
            continue
        role = roles[binding["roleRef"]["name"]]
        for rule in role["rules"]:
            assert not rule.get("resourceNames") and not rule.get("nonResourceURLs")
            granted |= {
                (group, resource, verb)
                for group in rule["apiGroups"]
                for resource in rule["resources"]
                for verb in rule["verbs"]
            }
    return granted


def test_rbac_is_least_privilege() -> None:
    namespace = one("Namespace", "gpushare-system")["metadata"]["name"]
    assert grants_of("gpushare-node-agent", namespace) == NODE_AGENT_GRANTS
    assert grants_of("gpushare-extender", namespace) == EXTENDER_GRANTS
    for role in (d for d in all_objects() if d["kind"] in ("ClusterRole", "Role")):
        for rule in role["rules"]:
            assert "*" not in [*rule["apiGroups"], *rule["resources"], *rule["verbs"]], role["metadata"]["name"]


def test_workloads_run_as_their_own_service_accounts() -> None:
    accounts = {
        (d["metadata"]["namespace"], d["metadata"]["name"]) for d in all_objects() if d["kind"] == "ServiceAccount"
    }
    for kind, name in (
        ("DaemonSet", "gpushare-node-agent"),
        ("Deployment", "gpushare-extender"),
        ("Deployment", "gpushare-scheduler"),
    ):
        workload = one(kind, name)
        assert (workload["metadata"]["namespace"], pod_spec(workload)["serviceAccountName"]) in accounts


# --- workloads --------------------------------------------------------------------------------------


def probe_paths(container: dict[str, Any]) -> set[str]:
    return {container[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe") if p in container}


def test_node_agent_daemonset() -> None:
    ds = one("DaemonSet", "gpushare-node-agent")
    spec = pod_spec(ds)
    assert spec["nodeSelector"], "the node agent must only run on GPU nodes"
    (container,) = spec["containers"]
    assert container["command"][:2] == ["gpushare", "node"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounted = {host_paths[m["name"]]: m["mountPath"] for m in container["volumeMounts"] if m["name"] in host_paths}
    assert mounted["/var/lib/kubelet/device-plugins"] == "/var/lib/kubelet/device-plugins"
    assert mounted["/run/containerd"] == "/run/containerd"
    runtime = next(a.split("=", 1)[1] for a in container["args"] if a.startswith("--runtime="))
    assert urlparse(runtime).path.startswith(mounted["/run/containerd"] + "/")
    env = {e["name"]: e for e in container["env"]}
    assert env[ENV_NODE_NAME]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert probe_paths(container) == {"/healthz", "/readyz"}
    assert container["resources"]["requests"].keys() >= {"cpu", "memory"}


def test_extender_deployment_and_service() -> None:
    deployment = one("Deployment", "gpushare-extender")
    assert deployment["spec"]["replicas"] == 2
    (container,) = pod_spec(deployment)["containers"]
    assert container["command"][:2] == ["gpushare", "extender"]
    assert probe_paths(container) == {"/healthz", "/readyz"}
    assert container["resources"]["requests"].keys() >= {"cpu", "memory"}
    args = dict(a.split("=", 1) for a in container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["https"] == int(args["--port"]) and ports["health"] == int(args["--health-port"])
    # the verbs need kube-scheduler's client certificate; the probes use the plain health port
    assert {"--tls-cert", "--tls-key", "--client-ca"} <= args.keys()
    probes = [container[p]["httpGet"]["port"] for p in ("livenessProbe", "readinessProbe")]
    assert set(probes) == {"health"}
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert all(any(args[f].startswith(f"{m}/") for m in mounted) for f in ("--tls-cert", "--tls-key", "--client-ca"))

    service = one("Service", "gpushare-extender")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"https"}
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP", "no NodePort: the verbs stay off the nodes"


@pytest.mark.parametrize(
    ("kind", "name", "flag", "port"),
    [
        ("DaemonSet", "gpushare-node-agent", "--metrics-host", "metrics"),
        ("Deployment", "gpushare-extender", "--health-host", "health"),
        ("Deployment", "gpushare-webhook", "--host", "https"),
    ],
)
def test_probe_ports_listen_on_the_pod_ip_and_the_command_takes_every_argument(
    kind: str, name: str, flag: str, port: str
) -> None:
    """Probes and Prometheus come to the pod's IP; nothing else of the node's (or pod's) is bound."""
    (container,) = pod_spec(one(kind, name))["containers"]
    args = dict(a.split("=", 1) for a in container["args"])
    assert args[flag] == "$(POD_IP)"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # kubelet puts the IP in; the command parses every argument as given, and serves the probed port
    parsed = build_parser().parse_args(
        [*container["command"][1:], *(a.replace("$(POD_IP)", "10.1.2.3") for a in container["args"])]
    )
    assert getattr(parsed, flag[2:].replace("-", "_")) == "10.1.2.3"
    served = {"metrics": "metrics_port", "health": "health_port", "https": "port"}[port]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}[port] == getattr(parsed, served)


def ingress_by_port(policy: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The NetworkPolicy's ingress rules by the port each admits to."""
    return {port["port"]: rule for rule in policy["spec"]["ingress"] for port in rule["ports"]}


@pytest.mark.parametrize("name", ["gpushare-extender", "gpushare-webhook"])
def test_a_network_policy_admits_to_each_port_of_the_pod_and_to_no_other(name: str) -> None:
    policy, deployment = one("NetworkPolicy", name), one("Deployment", name)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (container,) = pod_spec(deployment)["containers"]
    assert ingress_by_port(policy).keys() == {p["name"] for p in container["ports"]}


def test_the_extenders_plain_health_port_admits_only_the_monitoring_namespace() -> None:
    """/metrics there has no authentication and costs the verbs' time: not for any pod that asks.
    kubelet's probes come from the pod's own node, which NetworkPolicy always admits."""
    rules = ingress_by_port(one("NetworkPolicy", "gpushare-extender"))
    monitoring = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    assert rules["health"]["from"] == [{"namespaceSelector": monitoring, "podSelector": {}}]


def test_webhook_guards_pods_and_fails_closed() -> None:
    config = one("ValidatingWebhookConfiguration", "gpushare-pod-annotations")
    (hook,) = config["webhooks"]
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
    assert {op for r in hook["rules"] for op in r["operations"]} == {"CREATE", "UPDATE"}
    target = hook["clientConfig"]["service"]
    service = one("Service", target["name"])
    assert service["metadata"]["namespace"] == target["namespace"]
    (port,) = service["spec"]["ports"]
    assert port["port"] == target["port"]
    deployment = one("Deployment", "gpushare-webhook")
    (container,) = pod_spec(deployment)["containers"]
    assert container["command"][:2] == ["gpushare", "webhook"]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}
    policy = one("ValidatingAdmissionPolicy", "gpushare-pod-annotations")
    binding = one("ValidatingAdmissionPolicyBinding", "gpushare-pod-annotations")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]


#: the pod's subresources through which kube-apiserver's pod registry lets a request write the pod's
#: annotations, with the operation: pods/status takes metadata from the request, pods/binding copies
#: the Binding's annotations onto the pod (pods/ephemeralcontainers and pods/resize reset metadata)
ANNOTATION_WRITES = [("pods", "CREATE"), ("pods", "UPDATE"), ("pods/status", "UPDATE"), ("pods/binding", "CREATE")]
SYSTEM_NAMESPACES = ["kube-system", "kube-public", "kube-node-lease", "gpushare-system"]


def matches(rules: list[dict[str, Any]], resource: str, operation: str) -> bool:
    """Whether a request for ``resource`` (``pods/status`` for a subresource) in the core group matches
    one of ``rules``, as kube-apiserver matches admission rules (``*`` is not used here)."""
    return any(
        "" in r["apiGroups"]
        and "v1" in r["apiVersions"]
        and operation in r["operations"]
        and resource in r["resources"]
        for r in rules
    )


def selected(hook: dict[str, Any], namespace: str) -> bool:
    """Whether the webhook's namespaceSelector takes a namespace (its only selector here is by name)."""
    expressions = (hook.get("namespaceSelector") or {}).get("matchExpressions") or []
    for e in expressions:
        assert e["key"] == "kubernetes.io/metadata.name" and e["operator"] == "NotIn", e
    return not any(namespace in e["values"] for e in expressions)


@pytest.mark.parametrize(("resource", "operation"), ANNOTATION_WRITES)
def test_every_way_to_write_a_pods_annotations_is_covered(resource: str, operation: str) -> None:
    (hook,) = one("ValidatingWebhookConfiguration", "gpushare-pod-annotations")["webhooks"]
    assert matches(hook["rules"], resource, operation) and selected(hook, "team-a")
    policy = one("ValidatingAdmissionPolicy", "gpushare-pod-annotations")
    assert matches(policy["spec"]["matchConstraints"]["resourceRules"], resource, operation)


@pytest.mark.parametrize("namespace", SYSTEM_NAMESPACES)
def test_the_webhook_never_stands_between_the_control_plane_and_its_pods(namespace: str) -> None:
    (hook,) = one("ValidatingWebhookConfiguration", "gpushare-pod-annotations")["webhooks"]
    assert not selected(hook, namespace)
    # and kubelet's status updates and other writes that leave the annotations alone never reach it
    conditions = {c["name"]: c["expression"] for c in hook["matchConditions"]}
    assert "oldObject.metadata.?annotations" in conditions["annotations-may-change"]


def test_every_workload_runs_the_image_built_here() -> None:
    workloads = [o for o in all_objects() if o["kind"] in {"Deployment", "DaemonSet"}]
    images = {c["image"] for w in workloads for c in pod_spec(w)["containers"]}
    assert workloads and images == {IMAGE}, images


# --- examples ---------------------------------------------------------------------------------------


def example_pods() -> dict[str, dict[str, Any]]:
    pods = [d for path in sorted(DEPLOY.glob("examples/*.yaml")) for d in documents(path)]
    assert all(p["kind"] == "Pod" for p in pods)
    return {p["metadata"]["name"]: p for p in pods}


def test_examples_cover_every_case() -> None:
    requests = {name: parse_pod_request(p) for name, p in example_pods().items()}
    single = [r for r in requests.values() if len(r.gpu_containers) == 1 and r.gpu_containers[0].cards == 1]
    assert len([r for r in single if r.effective_mem <= 16]) >= 2, "two shared single-card pods"
    assert any(len(r.gpu_containers) >= 2 for r in requests.values()), "a multi-container pod"
    assert any(ctr.count == 2 and ctr.mem > 0 for r in requests.values() for ctr in r.gpu_containers), (
        "a pod on two cards, sharing them"
    )
    # GiB per card, on each node of the example cluster (the sandbox's and the e2e tests')
    cards = {
        spec.name: [c.memory_mib // 1024 for c in simulated_cards(spec.name, spec.gpus)]
        for spec in map(parse_node, DEFAULT_NODES)
    }
    assert any(
        all(r.effective_mem > max(gib) for gib in cards.values())
        and any(r.effective_mem <= sum(gib) for gib in cards.values())
        for r in requests.values()
    ), "a pod larger than any card, which some node's cards could hold between them (the extender then says why)"
    sneaky = [
        p
        for name, p in example_pods().items()
        if not requests[name].gpu_containers
        and any(
            e.get("name") == ENV_VISIBLE_DEVICES and e.get("value") == "all"
            for ctr in p["spec"]["containers"]
            for e in ctr.get("env") or []
        )
    ]
    assert sneaky, "a pod that requests no GPU but sets the visible-devices variable to all"


# --- scheduler configuration ------------------------------------------------------------------------


def test_scheduler_config_has_the_extender_entry() -> None:
    if not SCHEDULER_CONFIG.exists():
        pytest.skip("deploy/scheduler-config.yaml is not in this tree")
    (config,) = documents(SCHEDULER_CONFIG)
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == SCHEDULER_CONFIG_KIND
    (extender,) = [
        e for e in config["extenders"] if RESOURCE_MEM in {r["name"] for r in e.get("managedResources") or []}
    ]
    for verb in ("filterVerb", "prioritizeVerb", "bindVerb", "preemptVerb"):
        assert isinstance(extender.get(verb), str) and extender[verb], verb
    assert {r["name"] for r in extender["managedResources"]} == set(RESOURCES)
    assert all(isinstance(r.get("ignoredByScheduler", False), bool) for r in extender["managedResources"])
    assert extender["nodeCacheCapable"] is True
    assert extender["ignorable"] is False
    assert isinstance(extender.get("weight", 1), int) and extender.get("weight", 1) > 0

    service = one("Service", "gpushare-extender")
    url = urlparse(extender["urlPrefix"])
    assert url.port in {p["port"] for p in service["spec"]["ports"]}, "urlPrefix must reach the extender's Service"
    assert url.hostname == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    # HTTPS with a client certificate; the fields kube-scheduler's tlsConfig has
    assert url.scheme == "https" and extender["enableHTTPS"] is True
    tls = extender["tlsConfig"]
    assert tls.keys() <= {"insecure", "serverName", "certFile", "keyFile", "caFile", "certData", "keyData", "caData"}
    assert tls["insecure"] is False and {"certFile", "keyFile", "caFile"} <= tls.keys()
    assert tls["serverName"] == url.hostname


def test_every_scheduler_config_entry_reaches_the_extender_over_its_tls() -> None:
    """The extender serves only HTTPS with a client certificate once it has one, so an entry in plain
    HTTP (or to another address) would fail on every call, silently where the entry is ignorable."""
    (config,) = documents(SCHEDULER_CONFIG)
    first, *others = config["extenders"]
    assert others, "the entry that scores pods without GPUs is missing"
    for entry in others:
        assert entry["urlPrefix"] == first["urlPrefix"]
        assert entry["enableHTTPS"] is True and entry["tlsConfig"] == first["tlsConfig"]
