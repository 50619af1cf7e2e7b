"""The Helm chart in deploy/helm/gpushare: it lints, renders what deploy/*.yaml holds at its default values
(plus the certificates it makes), its values change what they say, and what it renders validates."""

from __future__ import annotations

import ast
import base64
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from support.docfiles import OPERATIONS, blocks

from gpushare.cli import build_parser
from gpushare.contract.names import (
    DEFAULT_SCHEDULER_NAME,
    NAMESPACE_LABEL_SCHEDULER,
    NAMESPACE_SCHEDULER_OPT_OUT,
    RESOURCES,
    SCHEDULER_NAME,
)
from gpushare.sandbox import binaries

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "gpushare"
NAMESPACE = "gpushare-system"
#: the oldest Kubernetes the manifests support, as tests/deploy/test_deploy_manifests.py validates them
KUBERNETES_VERSION = "1.30"
#: the kinds of the chart's own kube-scheduler (scheduler.enabled) that only newer releases serve, with the
#: release they are validated for: the one the e2e tests run
NEWER_KINDS = {"MutatingAdmissionPolicy": "1.37", "MutatingAdmissionPolicyBinding": "1.37"}
#: the Secrets the chart makes itself (certificates.source chart, the default; deploy/ leaves them to the operator)
GENERATED_SECRETS = {
    "gpushare-ca",
    "gpushare-client-ca",
    "gpushare-extender-tls",
    "gpushare-scheduler-client-ca",
    "gpushare-scheduler-client",
    "gpushare-webhook-tls",
}
#: where helm renders for: the namespace deploy/ uses, on the Kubernetes version under test
TARGET = ("--namespace", NAMESPACE, "--kube-version", binaries.KUBE_VERSION)

pytestmark = pytest.mark.skipif(
    binaries.missing((binaries.HELM,)) is not None, reason=f"{binaries.missing((binaries.HELM,))}"
)

Key = tuple[str, str, str]


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binaries.built(binaries.HELM)), *args], capture_output=True, text=True, check=False)


def render(*settings: str) -> list[dict[str, Any]]:
    """``helm template`` of the chart into gpushare's namespace, with ``--set`` for each of ``settings``."""
    done = helm("template", "gpushare", str(CHART), *TARGET, *(f"--set={s}" for s in settings))
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def key(obj: dict[str, Any]) -> Key:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def by_key(objects: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    keyed = {key(o): o for o in objects}
    assert len(keyed) == len(objects), "two objects with one name"
    return keyed


def from_deploy(*left_out: str) -> dict[Key, dict[str, Any]]:
    """deploy/*.yaml as the chart renders it: the Namespace is helm's (``--create-namespace``), and
    kube-scheduler's configuration is the ConfigMap gpushare-scheduler-config."""
    objects = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name in {"namespace.yaml", *left_out}:
            continue
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        if path.name == "scheduler-config.yaml":
            (config,) = docs
            docs = [scheduler_config_map(config)]
        objects += docs
    return by_key([parse_scheduler_configs(o) for o in objects])


def scheduler_config_map(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "gpushare-scheduler-config",
            "namespace": NAMESPACE,
            "labels": {"app.kubernetes.io/part-of": "gpushare"},
        },
        "data": {"scheduler-config.yaml": config},
    }


def parse_scheduler_configs(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with each kube-scheduler configuration a ConfigMap holds parsed (comments aside)."""
    if obj["kind"] == "ConfigMap":
        obj["data"] = {k: yaml.safe_load(v) if isinstance(v, str) else v for k, v in obj["data"].items()}
    return obj


def comparable(rendered: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    """The rendered objects without the generated Secrets and the webhook's caBundle (which deploy/ leaves
    to the operator), with the scheduler configurations parsed."""
    objects = by_key(
        [
            parse_scheduler_configs(o)
            for o in rendered
            if not (o["kind"] == "Secret" and o["metadata"]["name"] in GENERATED_SECRETS)
        ]
    )
    for (kind, _, _), obj in objects.items():
        if kind == "ValidatingWebhookConfiguration":
            for hook in obj["webhooks"]:
                hook["clientConfig"]["caBundle"] = ""
    return objects


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def pod_templates(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]
        for o in objects
        if o["kind"] in ("DaemonSet", "Deployment")
    }


def args_of(objects: list[dict[str, Any]], kind: str, name: str) -> list[str]:
    (container,) = one(objects, kind, name)["spec"]["template"]["spec"]["containers"]
    return container["args"]


def test_helm_is_the_pinned_version() -> None:
    done = helm("version", "--short")
    assert done.stdout.startswith(binaries.HELM_VERSION + "+") or done.stdout.strip() == binaries.HELM_VERSION


def test_the_chart_lints() -> None:
    done = helm("lint", "--strict", str(CHART), *TARGET)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("settings", "left_out"),
    [
        ((), ("webhook.yaml", "scheduler-config.yaml")),
        (("admission=webhook",), ("admission-policy.yaml", "scheduler-config.yaml")),
        (("admission=both",), ("scheduler-config.yaml",)),
        (("scheduler.enabled=false",), ("webhook.yaml", "scheduler.yaml")),
    ],
)
def test_the_chart_renders_what_deploy_holds(settings: tuple[str, ...], left_out: tuple[str, ...]) -> None:
    """At default values (admission=policy, scheduler.enabled) the chart is deploy/*.yaml without the
    webhook and without the configuration to copy onto the control plane; each admission value gives the
    deploy/ files it names, and scheduler.enabled=false that configuration instead of deploy/scheduler.yaml."""
    rendered, expected = comparable(render(*settings)), from_deploy(*left_out)
    assert rendered.keys() == expected.keys()
    for k, obj in expected.items():
        assert rendered[k] == obj, k


def test_generated_certificates_chain_to_their_cas() -> None:
    objects = render("admission=webhook")
    secrets = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "Secret"}
    assert secrets.keys() == GENERATED_SECRETS

    def pem(b64: str) -> x509.Certificate:
        return x509.load_pem_x509_certificate(base64.b64decode(b64))

    ca = pem(secrets["gpushare-ca"]["tls.crt"])
    (hook,) = one(objects, "ValidatingWebhookConfiguration", "gpushare-pod-annotations")["webhooks"]
    assert pem(hook["clientConfig"]["caBundle"]) == ca
    assert pem(secrets["gpushare-scheduler-client"]["extender-ca.crt"]) == ca
    for secret, host in (
        ("gpushare-extender-tls", f"gpushare-extender.{NAMESPACE}.svc"),
        ("gpushare-webhook-tls", f"gpushare-webhook.{NAMESPACE}.svc"),
    ):
        cert = pem(secrets[secret]["tls.crt"])
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == [host]
    # the extender lets through to /bind whatever its client CA signed: kube-scheduler's certificate alone
    client_ca = pem(secrets["gpushare-client-ca"]["tls.crt"])
    assert client_ca != ca and pem(secrets["gpushare-scheduler-client-ca"]["ca.crt"]) == client_ca
    pem(secrets["gpushare-scheduler-client"]["scheduler-client.crt"]).verify_directly_issued_by(client_ca)
    # what kube-scheduler's configuration checks the extender's certificate against
    config = yaml.safe_load(one(objects, "ConfigMap", "gpushare-kube-scheduler")["data"]["config.yaml"])
    assert config["extenders"][0]["tlsConfig"]["serverName"] == f"gpushare-extender.{NAMESPACE}.svc"


def test_existing_secrets_are_used_as_named() -> None:
    objects = render(
        "admission=webhook",
        "certificates.source=secrets",
        "certificates.extenderTLSSecret=ours-extender",
        "certificates.webhookCABundle=Q0E=",
    )
    assert not [o for o in objects if o["kind"] == "Secret"]
    volumes = {v["name"]: v["secret"]["secretName"] for v in pod_templates(objects)["gpushare-extender"]["volumes"]}
    assert volumes["tls"] == "ours-extender"
    (hook,) = one(objects, "ValidatingWebhookConfiguration", "gpushare-pod-annotations")["webhooks"]
    assert hook["clientConfig"]["caBundle"] == "Q0E="


@pytest.mark.parametrize(
    ("setting", "kind", "name", "arg"),
    [
        ("policy=spread", "Deployment", "gpushare-extender", "--policy=spread"),
        ("memoryUnit=MiB", "DaemonSet", "gpushare-node-agent", "--memory-unit=MiB"),
        ("gpuCountReplicas=4", "DaemonSet", "gpushare-node-agent", "--count-replicas=4"),
    ],
)
def test_a_value_becomes_the_components_flag(setting: str, kind: str, name: str, arg: str) -> None:
    default = args_of(render(), kind, name)
    changed = args_of(render(setting), kind, name)
    assert arg not in default and arg in changed
    # the component takes the flag as rendered
    (container,) = one(render(setting), kind, name)["spec"]["template"]["spec"]["containers"]
    build_parser().parse_args([*container["command"][1:], *(a.replace("$(POD_IP)", "10.1.2.3") for a in changed)])


def test_the_image_value_changes_every_pod() -> None:
    templates = pod_templates(render("admission=both", "image.repository=registry.example/gpushare", "image.tag=9.9"))
    assert templates.keys() == {"gpushare-node-agent", "gpushare-extender", "gpushare-webhook", "gpushare-scheduler"}
    for spec in templates.values():
        assert {c["image"] for c in spec["containers"]} == {"registry.example/gpushare:9.9"}


def test_node_selector_replicas_and_resources() -> None:
    objects = render("nodeAgent.nodeSelector.gpu=yes", "extender.replicas=3", "extender.resources.limits.memory=2Gi")
    assert pod_templates(objects)["gpushare-node-agent"]["nodeSelector"] == {"gpushare": "true", "gpu": "yes"}
    extender = one(objects, "Deployment", "gpushare-extender")
    assert extender["spec"]["replicas"] == 3
    (container,) = extender["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {"memory": "2Gi"}


def test_the_nvml_library_value_moves_only_the_host_path() -> None:
    """On RHEL the driver's library is under /usr/lib64; inside the pod it stays where the image looks."""
    spec = pod_templates(render("nodeAgent.nvmlLibrary=/usr/lib64/libnvidia-ml.so.1"))["gpushare-node-agent"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "nvml"]
    assert volume["hostPath"] == {"path": "/usr/lib64/libnvidia-ml.so.1", "type": "File"}
    (container,) = spec["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "nvml"]
    assert mount["mountPath"] == "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"


def test_the_dra_value_deploys_the_device_class_and_has_the_node_agents_serve_the_cards_it_names() -> None:
    plain = render()
    assert not [o for o in plain if o["kind"] == "DeviceClass"]
    (agent,) = pod_templates(plain)["gpushare-node-agent"]["containers"]
    assert not [a for a in agent["args"] if a.startswith("--dra")]

    objects = render("dra.enabled=true", r"dra.cards=2\,3")
    (device_class,) = [o for o in objects if o["kind"] == "DeviceClass"]
    (expected,) = [d for d in yaml.safe_load_all((DEPLOY / "dra" / "deviceclass.yaml").read_text()) if d]
    assert device_class == expected
    spec = pod_templates(objects)["gpushare-node-agent"]
    (agent,) = spec["containers"]
    assert {"--dra", "--dra-cards=2,3", "--kubelet-root=/var/lib/kubelet", "--cdi-dir=/var/run/cdi"} <= set(
        agent["args"]
    )
    mounts = {m["mountPath"] for m in agent["volumeMounts"]}
    assert {"/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/run/cdi"} <= mounts
    paths = {v["hostPath"]["path"] for v in spec["volumes"]}
    assert {"/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/run/cdi"} <= paths
    for obj in objects:  # DeviceClass is resource.k8s.io/v1: checked against the release the e2e tests run
        kubernetes_validate.validate(obj, "1.37", strict=True)


def test_the_chart_renders_without_kube_version_as_argo_cd_and_a_release_helm_do() -> None:
    """helm's default Kubernetes version is its client-go's (build_kube.sh stamps it as helm's release
    build does), which the chart's kubeVersion (>=1.30) accepts."""
    done = helm("template", "gpushare", str(CHART), "--namespace", NAMESPACE)
    assert done.returncode == 0, done.stderr


def test_an_unknown_admission_value_is_refused_by_name() -> None:
    done = helm("template", "gpushare", str(CHART), *TARGET, "--set=admission=off")
    assert done.returncode != 0 and 'admission: "off" is not one of policy, webhook, both' in done.stderr


def validate(obj: dict[str, Any]) -> None:
    """``obj`` against the oldest release that the chart supports, or that serves its kind."""
    try:
        kubernetes_validate.validate(obj, NEWER_KINDS.get(obj["kind"], KUBERNETES_VERSION), strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {exc.message} at {list(exc.path)}")


@pytest.mark.parametrize("settings", [("admission=policy",), ("admission=webhook",), ("scheduler.enabled=false",)])
def test_what_the_chart_renders_is_valid_for_kubernetes(settings: tuple[str, ...]) -> None:
    for obj in render(*settings):
        validate(obj)


def test_the_guides_values_file_sets_the_image(tmp_path: Path) -> None:
    (example,) = [b for b in blocks(OPERATIONS) if b.language == "yaml" and b.text.startswith("# my-values.yaml")]
    values = tmp_path / "my-values.yaml"
    values.write_text(example.text.replace("<registry>", "registry.example"))
    done = helm("template", "gpushare", str(CHART), *TARGET, "-f", str(values))
    assert done.returncode == 0, done.stderr
    templates = pod_templates([d for d in yaml.safe_load_all(done.stdout) if d])
    assert {c["image"] for spec in templates.values() for c in spec["containers"]} == {
        "registry.example/gpushare:0.1.0"
    }


def test_the_dra_steering_value_is_the_extenders_flag_and_off_by_default() -> None:
    (plain,) = pod_templates(render())["gpushare-extender"]["containers"]
    (steering,) = pod_templates(render("extender.draSteering=true"))["gpushare-extender"]["containers"]
    assert "--dra-steering" not in plain["args"] and "--dra-steering" in steering["args"]


def test_the_dra_order_value_is_the_node_agents_flag_and_best_fit_lets_it_watch_claims() -> None:
    def claim_verbs(objects: list[dict[str, Any]]) -> list[str]:
        rules = one(objects, "ClusterRole", "gpushare-node-agent")["rules"]
        (verbs,) = [r["verbs"] for r in rules if r["resources"] == ["resourceclaims"]]
        return verbs

    plain = render("dra.enabled=true")
    assert "--dra-order=index" in args_of(plain, "DaemonSet", "gpushare-node-agent")
    assert claim_verbs(plain) == ["get"]
    best_fit = render("dra.enabled=true", "dra.order=best-fit")
    assert "--dra-order=best-fit" in args_of(best_fit, "DaemonSet", "gpushare-node-agent")
    assert claim_verbs(best_fit) == ["get", "list", "watch"]
    assert claim_verbs(render("dra.order=best-fit")) == ["get"]  # no DRA, no slice to order
    done = helm("template", "gpushare", str(CHART), *TARGET, "--set=dra.enabled=true", "--set=dra.order=tightest")
    assert done.returncode != 0 and 'dra.order: "tightest" is not one of index, best-fit' in done.stderr


# --- certificates made outside the chart, for GitOps ------------------------------------------------------

#: values that name the operator's own Secrets (certificates.source secrets), webhook included
OPERATORS_SECRETS = (
    "admission=both",
    "certificates.source=secrets",
    "certificates.extenderTLSSecret=ops-extender",
    "certificates.schedulerClientCASecret=ops-client-ca",
    "certificates.webhookTLSSecret=ops-webhook",
    "certificates.webhookCABundle=Q0E=",
)
#: the fields of cert-manager's v1 Certificate spec (its API reference, "CertificateSpec"): secretName and
#: issuerRef are required; each usage is one of the API's key usage names
CERTIFICATE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["secretName", "issuerRef"],
    "additionalProperties": False,
    "properties": {
        "secretName": {"type": "string", "minLength": 1},
        "commonName": {"type": "string", "maxLength": 64},
        "dnsNames": {"type": "array", "items": {"type": "string"}},
        "duration": {"type": "string", "pattern": r"^[0-9]+h$"},
        "isCA": {"type": "boolean"},
        "usages": {
            "type": "array",
            "items": {"enum": ["server auth", "client auth", "digital signature", "key encipherment", "cert sign"]},
        },
        "privateKey": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]}, "size": {"type": "integer"}},
        },
        "issuerRef": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string"},
                "kind": {"enum": ["Issuer", "ClusterIssuer"]},
                "group": {"const": "cert-manager.io"},
            },
        },
    },
}


def render_text(*settings: str) -> str:
    done = helm("template", "gpushare", str(CHART), *TARGET, *(f"--set={s}" for s in settings))
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("settings", [OPERATORS_SECRETS, ("admission=both", "certificates.source=certManager")])
def test_with_certificates_made_outside_the_chart_two_renders_are_the_same_bytes(settings: tuple[str, ...]) -> None:
    """What Argo CD needs: a render is a function of the values alone, with no key in it."""
    first, second = render_text(*settings), render_text(*settings)
    assert first == second
    assert "PRIVATE KEY" not in first and not [d for d in yaml.safe_load_all(first) if d and d["kind"] == "Secret"]
    # the chart's own certificates are made anew at each render: what the two values above avoid
    assert render_text("admission=both") != render_text("admission=both")


def test_the_operators_secrets_are_what_every_workload_mounts() -> None:
    objects = render(*OPERATORS_SECRETS)
    mounted = {
        name: {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        for name, spec in pod_templates(objects).items()
    }
    assert mounted["gpushare-extender"] == {"tls": "ops-extender", "client-ca": "ops-client-ca"}
    assert mounted["gpushare-webhook"] == {"tls": "ops-webhook"}
    (hook,) = one(objects, "ValidatingWebhookConfiguration", "gpushare-pod-annotations")["webhooks"]
    assert hook["clientConfig"]["caBundle"] == "Q0E="
    assert not [o for o in objects if o["apiVersion"].startswith("cert-manager.io/")]


def test_the_operators_secrets_with_the_webhook_and_no_ca_bundle_are_refused_by_name() -> None:
    done = helm(
        "template", "gpushare", str(CHART), *TARGET, "--set=admission=webhook", "--set=certificates.source=secrets"
    )
    assert done.returncode != 0 and "certificates.webhookCABundle: empty" in done.stderr


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("certificates.generate=false", "certificates.generate is replaced by certificates.source"),
        ("certificates.source=vault", 'certificates.source: "vault" is not one of chart, certManager, secrets'),
    ],
)
def test_a_certificates_value_the_chart_cant_use_is_refused_by_name(setting: str, says: str) -> None:
    done = helm("template", "gpushare", str(CHART), *TARGET, f"--set={setting}")
    assert done.returncode != 0 and says in done.stderr


def test_cert_manager_certificates_chain_to_what_each_workload_mounts() -> None:
    objects = render("admission=both", "certificates.source=certManager", "certificates.validityDays=365")
    issuers = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Issuer"}
    certificates = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Certificate"}
    for obj in objects:
        if not obj["apiVersion"].startswith("cert-manager.io/"):
            validate(obj)
            continue
        assert obj["apiVersion"] == "cert-manager.io/v1" and obj["metadata"]["namespace"] == NAMESPACE
        if obj["kind"] == "Certificate":
            jsonschema.validate(obj["spec"], CERTIFICATE_SCHEMA)
    assert not [o for o in objects if o["kind"] == "Secret"]
    # a self-signed issuer signs the two CAs; each CA's own issuer signs from its Secret
    assert issuers == {
        "gpushare-selfsigned": {"selfSigned": {}},
        "gpushare-ca": {"ca": {"secretName": "gpushare-ca"}},
        "gpushare-client-ca": {"ca": {"secretName": "gpushare-client-ca"}},
    }
    for ca in ("gpushare-ca", "gpushare-client-ca"):
        assert certificates[ca]["isCA"] and certificates[ca]["secretName"] == ca
        assert certificates[ca]["issuerRef"]["name"] == "gpushare-selfsigned"
    signed_by = {name: spec["issuerRef"]["name"] for name, spec in certificates.items() if not spec.get("isCA")}
    assert signed_by == {
        "gpushare-extender-tls": "gpushare-ca",
        "gpushare-webhook-tls": "gpushare-ca",
        "gpushare-scheduler-client": "gpushare-client-ca",  # anything this CA signs may call /bind
    }
    assert all(spec["duration"] == "8760h" for spec in certificates.values())
    templates = pod_templates(objects)
    for workload, certificate in (
        ("gpushare-extender", "gpushare-extender-tls"),
        ("gpushare-webhook", "gpushare-webhook-tls"),
    ):
        (tls,) = [v for v in templates[workload]["volumes"] if v["name"] == "tls"]
        assert tls["secret"]["secretName"] == certificates[certificate]["secretName"]
        host = f"{workload}.{NAMESPACE}.svc"
        assert certificates[certificate]["dnsNames"] == [host] and "server auth" in certificates[certificate]["usages"]
    assert "client auth" in certificates["gpushare-scheduler-client"]["usages"]
    # the extender trusts the client CA's certificate alone: the CA's key is never in its pod
    (client_ca,) = [v for v in templates["gpushare-extender"]["volumes"] if v["name"] == "client-ca"]
    assert client_ca["secret"] == {"secretName": "gpushare-client-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    # cainjector writes the webhook's caBundle from the CA of the webhook's Certificate
    config = one(objects, "ValidatingWebhookConfiguration", "gpushare-pod-annotations")
    assert config["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": f"{NAMESPACE}/gpushare-webhook-tls"}
    (hook,) = config["webhooks"]
    assert "caBundle" not in hook["clientConfig"]


def test_cert_manager_without_the_webhook_makes_no_webhook_certificate() -> None:
    objects = render("certificates.source=certManager")
    names = {o["metadata"]["name"] for o in objects if o["kind"] == "Certificate"}
    assert names == {"gpushare-ca", "gpushare-client-ca", "gpushare-extender-tls", "gpushare-scheduler-client"}


def policies(objects: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each NetworkPolicy's ingress rules by the port each admits to, by the policy's name."""
    return {
        o["metadata"]["name"]: {port["port"]: rule for rule in o["spec"]["ingress"] for port in rule["ports"]}
        for o in objects
        if o["kind"] == "NetworkPolicy"
    }


def test_the_control_plane_cidrs_narrow_who_reaches_the_verbs_and_the_webhook() -> None:
    rendered = policies(render("admission=webhook", r"networkPolicy.controlPlaneCIDRs={10.0.0.0/24,10.0.1.5/32}"))
    for name, component in (("gpushare-extender", "kube-scheduler"), ("gpushare-webhook", "kube-apiserver")):
        peers = rendered[name]["https"]["from"]
        assert [p["ipBlock"]["cidr"] for p in peers if "ipBlock" in p] == ["10.0.0.0/24", "10.0.1.5/32"]
        assert {"matchLabels": {"component": component}} in [p.get("podSelector") for p in peers]
    # without them, the TLS ports admit any address: the handshake is the guard
    assert "from" not in policies(render("admission=webhook"))["gpushare-webhook"]["https"]


def test_the_metrics_peers_are_a_value_and_none_closes_the_health_port_to_all_but_the_node() -> None:
    peers = policies(render("networkPolicy.metricsFrom[0].podSelector.matchLabels.app=prometheus"))
    (peer,) = peers["gpushare-extender"]["health"]["from"]
    assert peer["podSelector"] == {"matchLabels": {"app": "prometheus"}}
    assert "health" not in policies(render("networkPolicy.metricsFrom=null"))["gpushare-extender"]


def test_the_network_policies_can_be_left_out() -> None:
    assert not policies(render("admission=both", "networkPolicy.enabled=false"))


# --- the chart's own kube-scheduler (scheduler.enabled) ---------------------------------------------------


def scheduler_config(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(one(objects, "ConfigMap", "gpushare-kube-scheduler")["data"]["config.yaml"])


def test_the_scheduler_serves_its_profile_with_the_extender_entries_of_the_control_plane_path() -> None:
    objects = render()
    config = scheduler_config(objects)
    assert config["profiles"] == [{"schedulerName": SCHEDULER_NAME}]
    assert config["leaderElection"] == {
        "leaderElect": True,
        "resourceLock": "leases",
        "resourceName": SCHEDULER_NAME,
        "resourceNamespace": NAMESPACE,
    }
    assert "clientConnection" not in config, "the pod's service account, not a kubeconfig file"
    # the same two entries as the configuration copied onto the control plane (scheduler.enabled=false)
    (copied,) = [d for d in yaml.safe_load_all((DEPLOY / "scheduler-config.yaml").read_text()) if d]
    assert config["extenders"] == copied["extenders"] and len(config["extenders"]) == 2
    assert not [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gpushare-scheduler-config"]


def test_the_scheduler_deployment_runs_the_launcher_with_the_files_its_configuration_names() -> None:
    objects = render()
    deployment = one(objects, "Deployment", "gpushare-scheduler")
    assert deployment["spec"]["replicas"] == 2
    spec = deployment["spec"]["template"]["spec"]
    # its own pods are placed by the control plane's scheduler, never by itself
    assert spec["schedulerName"] == "default-scheduler" and spec["serviceAccountName"] == "gpushare-scheduler"
    # the Service's variables, where the launcher finds the extender without cluster DNS
    assert spec["enableServiceLinks"] is True
    (container,) = spec["containers"]
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert args.run.__module__ == "gpushare.extender.kubescheduler"
    assert args.scheduler_args[1:] == ["--feature-gates=SchedulerPopFromBackoffQ=false", "--v=2"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts[str(Path(args.config).parent)]]["configMap"]["name"] == "gpushare-kube-scheduler"
    assert "emptyDir" in volumes[mounts[str(Path(args.write_config).parent)]]
    for entry in scheduler_config(objects)["extenders"]:
        files = {Path(entry["tlsConfig"][f]) for f in ("certFile", "keyFile", "caFile")}
        (directory,) = {f.parent for f in files}
        client_volume = volumes[mounts[str(directory)]]
        assert client_volume["secret"]["secretName"] == "gpushare-scheduler-client"
    # the chart makes that Secret with the files' names as its keys
    secret = one(objects, "Secret", "gpushare-scheduler-client")
    assert set(secret["data"]) == {f.name for f in files}
    probes = [container[p]["httpGet"] for p in ("livenessProbe", "readinessProbe")]
    assert {(p["port"], p["scheme"]) for p in probes} == {("https", "HTTPS")}
    assert {p["containerPort"] for p in container["ports"]} == {10259}  # kube-scheduler's secure port


def test_with_cert_manager_the_scheduler_mounts_its_files_from_the_two_certificates_secrets() -> None:
    objects = render("certificates.source=certManager")
    (volume,) = [v for v in pod_templates(objects)["gpushare-scheduler"]["volumes"] if v["name"] == "extender-client"]
    sources = {
        s["secret"]["name"]: {i["key"]: i["path"] for i in s["secret"]["items"]} for s in volume["projected"]["sources"]
    }
    assert sources == {
        "gpushare-scheduler-client": {"tls.crt": "scheduler-client.crt", "tls.key": "scheduler-client.key"},
        "gpushare-extender-tls": {"ca.crt": "extender-ca.crt"},
    }


def test_the_schedulers_rbac_is_kubernetes_own_scheduler_roles_and_its_own_lease() -> None:
    objects = render("scheduler.name=gpu-sched")
    subject = [{"kind": "ServiceAccount", "name": "gpushare-scheduler", "namespace": NAMESPACE}]
    bound = {
        (o["kind"], o["metadata"].get("namespace", ""), o["roleRef"]["kind"], o["roleRef"]["name"])
        for o in objects
        if o["kind"] in ("ClusterRoleBinding", "RoleBinding") and o["subjects"] == subject
    }
    assert bound == {
        ("ClusterRoleBinding", "", "ClusterRole", "system:kube-scheduler"),
        ("ClusterRoleBinding", "", "ClusterRole", "system:volume-scheduler"),
        ("RoleBinding", NAMESPACE, "Role", "gpushare-scheduler-lease"),
        ("RoleBinding", "kube-system", "Role", "extension-apiserver-authentication-reader"),
    }
    (rule,) = one(objects, "Role", "gpushare-scheduler-lease")["rules"]
    assert rule["resources"] == ["leases"] and rule["resourceNames"] == ["gpu-sched"]
    assert scheduler_config(objects)["leaderElection"]["resourceName"] == "gpu-sched"
    assert scheduler_config(objects)["profiles"] == [{"schedulerName": "gpu-sched"}]
    (mutation,) = one(objects, "MutatingAdmissionPolicy", "gpushare-scheduler")["spec"]["mutations"]
    assert mutation["applyConfiguration"]["expression"] == "Object{spec: Object.spec{schedulerName: 'gpu-sched'}}"


def test_the_policy_reads_gpushares_resources_and_opt_out_label() -> None:
    """Its wire names are names.py's (tests/deploy/test_scheduler_policy.py runs it on kube-apiserver)."""
    spec = one(render(), "MutatingAdmissionPolicy", "gpushare-scheduler")["spec"]
    conditions = {c["name"]: " ".join(c["expression"].split()) for c in spec["matchConditions"]}
    (listed,) = re.findall(r"\[('[^]]*')\]", conditions["asks-for-gpushare"])
    assert set(ast.literal_eval(f"[{listed}]")) == set(RESOURCES)
    assert f"orValue('{DEFAULT_SCHEDULER_NAME}') == '{DEFAULT_SCHEDULER_NAME}'" in conditions["default-scheduler"]
    (expression,) = spec["matchConstraints"]["namespaceSelector"]["matchExpressions"]
    assert expression == {
        "key": NAMESPACE_LABEL_SCHEDULER,
        "operator": "NotIn",
        "values": [NAMESPACE_SCHEDULER_OPT_OUT],
    }
    binding = one(render(), "MutatingAdmissionPolicyBinding", "gpushare-scheduler")
    assert binding["spec"] == {"policyName": "gpushare-scheduler"}


def test_without_the_scheduler_the_control_plane_configuration_is_rendered_instead() -> None:
    objects = render("scheduler.enabled=false")
    assert one(objects, "ConfigMap", "gpushare-scheduler-config")
    assert not [
        o
        for o in objects
        if o["metadata"]["name"].startswith("gpushare-scheduler") and o["kind"] != "ConfigMap" and o["kind"] != "Secret"
    ]
    assert not [o for o in objects if o["kind"].startswith("MutatingAdmissionPolicy")]


def test_the_scheduler_on_a_release_without_mutating_admission_policies_is_refused_by_name() -> None:
    done = helm("template", "gpushare", str(CHART), "--namespace", NAMESPACE, "--kube-version", "1.35.0")
    assert done.returncode != 0
    assert "scheduler.enabled needs MutatingAdmissionPolicy" in done.stderr and "v1.35.0" in done.stderr
    done = helm(
        "template",
        "gpushare",
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        "1.35.0",
        "--set=scheduler.enabled=false",
    )
    assert done.returncode == 0, done.stderr


def test_the_control_plane_cidrs_admit_the_charts_own_scheduler_to_the_verbs() -> None:
    setting = r"networkPolicy.controlPlaneCIDRs={10.0.0.0/24}"
    own = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gpushare-scheduler"}}}
    assert own in policies(render(setting))["gpushare-extender"]["https"]["from"]
    assert own not in policies(render(setting, "scheduler.enabled=false"))["gpushare-extender"]["https"]["from"]


# --- how the node agent holds containers to their cards (nodeAgent.enforcement) ----------------------------


def agent(*settings: str) -> tuple[list[str], dict[str, str], dict[str, dict[str, str]]]:
    """The node agent's arguments, its mounts (path: volume) and its host paths (volume: hostPath)."""
    spec = pod_templates(render(*settings))["gpushare-node-agent"]
    (container,) = spec["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    return container["args"], mounts, {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}


def test_by_default_the_agent_is_an_nri_plugin_and_serves_no_cri_socket() -> None:
    args, mounts, host = agent()
    assert {"--enforcement=nri", "--nri-socket=/var/run/nri/nri.sock"} <= set(args)
    assert not [a for a in args if a.startswith("--listen")]
    assert host[mounts["/var/run/nri"]] == {"path": "/var/run/nri", "type": "DirectoryOrCreate"}
    assert "/run/gpushare" not in mounts


def test_the_cri_shim_enforcement_serves_kubelets_socket_from_a_shim_that_outlives_the_agent() -> None:
    args, mounts, host = agent("nodeAgent.enforcement=cri-shim")
    assert {"--enforcement=cri-shim", "--listen=unix:///run/gpushare/cri.sock"} <= set(args)
    assert not [a for a in args if a.startswith("--nri")]
    assert host[mounts["/run/gpushare"]] == {"path": "/run/gpushare", "type": "DirectoryOrCreate"}
    assert "/var/run/nri" not in mounts
    # the shim leaves the container's cgroup, into the host's hierarchy the agent mounts, and is found
    # again by the next agent: in the host's PID namespace, where a container is stopped by its cgroup
    assert "--detach-cri-shim=/host/sys/fs/cgroup" in args and mounts["/host/sys/fs/cgroup"] == "cgroup"
    spec = pod_templates(render("nodeAgent.enforcement=cri-shim"))["gpushare-node-agent"]
    assert spec["hostPID"] is True
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    nri = pod_templates(render())["gpushare-node-agent"]
    assert "hostPID" not in nri and "POD_UID" not in {e["name"] for e in nri["containers"][0]["env"]}


def test_an_unknown_enforcement_is_refused_by_name() -> None:
    done = helm("template", "gpushare", str(CHART), *TARGET, "--set=nodeAgent.enforcement=ebpf")
    assert done.returncode != 0 and 'nodeAgent.enforcement: "ebpf" is not one of nri, cri-shim' in done.stderr


# --- NOTES.txt --------------------------------------------------------------------------------------------


def notes(tmp_path: Path, *settings: str) -> str:
    """templates/NOTES.txt as ``helm install`` prints it (``helm template`` leaves it out: here it is
    rendered from a copy of the chart, as a template of its own)."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    text = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text('{{- define "notes" -}}\n' + text + "{{- end }}\n")
    (chart / "templates" / "notes.yaml").write_text('notes: |\n  {{- include "notes" . | nindent 2 }}\n')
    done = helm(
        "template",
        "gpushare",
        str(chart),
        *TARGET,
        "--show-only=templates/notes.yaml",
        *(f"--set={s}" for s in settings),
    )
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)["notes"]


def test_the_notes_say_what_to_check_and_that_nothing_is_left_to_do(tmp_path: Path) -> None:
    text = notes(tmp_path)
    assert f"kubectl -n {NAMESPACE} get pods -l app.kubernetes.io/name=gpushare-node-agent" in text
    assert "kubectl get nodes -l gpushare=true\n" in text
    assert f"kubectl -n {NAMESPACE} get lease {SCHEDULER_NAME} -o jsonpath='{{.spec.holderIdentity}}" in text
    assert "aliyun.com/gpu-mem: 1" in text and f"# {SCHEDULER_NAME}" in text
    assert "Nothing else to do" in text and "Still to do" not in text


@pytest.mark.parametrize(
    ("settings", "says", "not_says"),
    [
        (
            ("nodeAgent.enforcement=cri-shim",),
            "--container-runtime-endpoint=unix:///run/gpushare/cri.sock",
            "control-plane",
        ),
        (("scheduler.enabled=false",), "on each control-plane node", "container-runtime-endpoint"),
    ],
)
def test_the_notes_say_what_is_left_to_do(tmp_path: Path, settings: tuple[str, ...], says: str, not_says: str) -> None:
    text = notes(tmp_path, *settings)
    assert "Still to do" in text and says in text and not_says not in text
    assert "Nothing else to do" not in text
