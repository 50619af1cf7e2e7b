"""``gpushare kube-scheduler``, the command the chart's kube-scheduler Deployment runs: where the extender's
Service name resolves it keeps deploy/scheduler.yaml's configuration as it is; where it doesn't, each
extender entry goes to the Service's ClusterIP from kubelet's variables with the certificate still checked
against the name; what it lacks is named; and it becomes kube-scheduler with the written file and the
Deployment's flags, which the real kube-scheduler (where built) takes. No name is looked up: the resolver
is this test's."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpushare.extender import kubescheduler

from gpushare.cli import build_parser, main
from gpushare.contract.names import EXTENDER_SERVICE, service_env_prefix
from gpushare.sandbox import binaries
from gpushare.sandbox.certs import make_certs
from gpushare.settings import UsageError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NAME = "gpushare-extender.gpushare-system.svc"
ENV = {"GPUSHARE_EXTENDER_SERVICE_HOST": "10.96.0.20", "GPUSHARE_EXTENDER_SERVICE_PORT": "32766"}


def shipped() -> tuple[dict[str, Any], list[str]]:
    """deploy/scheduler.yaml's kube-scheduler configuration, and its Deployment's command and arguments."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "scheduler.yaml").read_text()) if d]
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "gpushare-kube-scheduler"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return yaml.safe_load(config_map["data"]["config.yaml"]), [*container["command"][1:], *container["args"]]


def no_dns(host: str) -> bool:
    return False


def test_the_variables_are_the_ones_kubelet_sets_for_the_extenders_service() -> None:
    assert {f"{service_env_prefix(EXTENDER_SERVICE)}_SERVICE_{part}" for part in ("HOST", "PORT")} == ENV.keys()


def test_where_the_name_resolves_the_configuration_is_kept() -> None:
    config, _ = shipped()
    assert kubescheduler.reachable(config, {}, lambda host: host == NAME) == config


def test_without_cluster_dns_each_entry_goes_to_the_service_address_and_checks_the_name() -> None:
    config, _ = shipped()
    written = kubescheduler.reachable(config, ENV, no_dns)
    assert len(written["extenders"]) == 2
    for before, after in zip(config["extenders"], written["extenders"], strict=True):
        assert before["urlPrefix"] == f"https://{NAME}:32766"
        assert after["urlPrefix"] == "https://10.96.0.20:32766"
        assert after["tlsConfig"] == {**before["tlsConfig"], "serverName": NAME}
        assert {k: v for k, v in after.items() if k != "urlPrefix"} == {
            k: v for k, v in before.items() if k != "urlPrefix"
        }
    # the rest of the file (profile, leader election) is untouched
    assert {k: v for k, v in written.items() if k != "extenders"} == {
        k: v for k, v in config.items() if k != "extenders"
    }


def test_an_entry_without_a_server_name_is_given_the_one_it_was_addressed_by() -> None:
    config = {"extenders": [{"urlPrefix": f"https://{NAME}/x", "enableHTTPS": True}]}
    (entry,) = kubescheduler.reachable(config, ENV, no_dns)["extenders"]
    # the URL names no port: the Service's first
    assert entry == {"urlPrefix": "https://10.96.0.20:32766/x", "enableHTTPS": True, "tlsConfig": {"serverName": NAME}}


def test_an_ipv6_cluster_ip_is_bracketed() -> None:
    config = {"extenders": [{"urlPrefix": f"https://{NAME}:32766"}]}
    env = {**ENV, "GPUSHARE_EXTENDER_SERVICE_HOST": "fd00:10:96::20"}
    (entry,) = kubescheduler.reachable(config, env, no_dns)["extenders"]
    assert entry["urlPrefix"] == "https://[fd00:10:96::20]:32766"


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({}, "GPUSHARE_EXTENDER_SERVICE_HOST and GPUSHARE_EXTENDER_SERVICE_PORT not set"),
        ({"GPUSHARE_EXTENDER_SERVICE_PORT": "32766"}, "GPUSHARE_EXTENDER_SERVICE_HOST not set"),
    ],
)
def test_missing_service_variables_are_named(env: dict[str, str], says: str) -> None:
    config, _ = shipped()
    with pytest.raises(UsageError) as refused:
        kubescheduler.reachable(config, env, no_dns)
    assert f"{NAME} does not resolve here" in str(refused.value) and says in str(refused.value)
    assert "Service gpushare-extender" in str(refused.value)


def test_a_host_that_names_no_service_and_does_not_resolve_is_named() -> None:
    config = {"extenders": [{"urlPrefix": "https://extender.example:32766"}]}
    with pytest.raises(UsageError, match=r"extender\.example does not resolve here, and names no Service"):
        kubescheduler.reachable(config, ENV, no_dns)


def launch(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str] = ENV
) -> tuple[argparse.Namespace, list[str]]:
    """Run ``gpushare`` with ``argv`` as far as its exec, with ``env`` and no cluster DNS; the arguments it
    parsed and the command line it would have become."""
    execs: list[list[str]] = []
    monkeypatch.setattr(kubescheduler, "resolves", no_dns)
    monkeypatch.setattr(os, "execv", lambda path, args: execs.append([path, *args[1:]]))
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(argv)
    assert args.run(args) == 0
    (command,) = execs
    return args, command


def test_it_becomes_kube_scheduler_with_the_written_file_and_the_deployments_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, argv = shipped()
    template, written, binary = tmp_path / "config.yaml", tmp_path / "written.yaml", tmp_path / "kube-scheduler"
    template.write_text(yaml.safe_dump(config))
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    # the Deployment's own command line, with the files where this test has them
    argv = [a for a in argv if not a.startswith(("--config=", "--write-config="))]
    argv[1:1] = [f"--config={template}", f"--write-config={written}", f"--kube-scheduler={binary}"]
    _, command = launch(monkeypatch, argv)
    assert command == [str(binary), f"--config={written}", "--feature-gates=SchedulerPopFromBackoffQ=false", "--v=2"]
    assert yaml.safe_load(written.read_text()) == kubescheduler.reachable(config, ENV, no_dns)
    assert "*" not in written.read_text(), "no YAML alias: each entry has its own tlsConfig"


def test_the_deployments_paths_are_the_commands_defaults() -> None:
    _, argv = shipped()
    args = build_parser().parse_args(argv)
    assert (args.config, args.write_config) == (kubescheduler.DEFAULT_CONFIG, kubescheduler.DEFAULT_WRITE_CONFIG)


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        (
            "--config=/nonexistent/config.yaml",
            "can't read the kube-scheduler configuration /nonexistent/config.yaml: No such file or directory",
        ),
        ("--kube-scheduler=/nonexistent/kube-scheduler", "no kube-scheduler binary at /nonexistent/kube-scheduler"),
    ],
)
def test_a_missing_file_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, says: str
) -> None:
    template = tmp_path / "config.yaml"
    template.write_text(yaml.safe_dump(shipped()[0]))
    argv = ["kube-scheduler", f"--config={template}", f"--write-config={tmp_path / 'w.yaml'}", flag]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"gpushare kube-scheduler: {says}\n"


@pytest.mark.skipif(
    binaries.missing(("kube-scheduler",)) is not None, reason=f"{binaries.missing(('kube-scheduler',))}"
)
def test_the_real_kube_scheduler_takes_the_written_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kube-scheduler loads and validates the file, builds the extenders from it (their certificate files
    must exist: here this test's), writes the configuration it would run with, and exits, without ever
    calling the API server it is given."""
    certs = make_certs(tmp_path / "certs", (NAME,))
    config, _ = shipped()
    files = {"certFile": certs.client.cert, "keyFile": certs.client.key, "caFile": certs.ca}
    for entry in config["extenders"]:
        entry["tlsConfig"] = {**entry["tlsConfig"], **files}
    template, effective = tmp_path / "config.yaml", tmp_path / "effective.yaml"
    template.write_text(yaml.safe_dump(config))
    extra = ["--master=https://127.0.0.1:1", f"--write-config-to={effective}"]
    argv = ["kube-scheduler", f"--config={template}", f"--write-config={tmp_path / 'written.yaml'}"]
    argv += [f"--kube-scheduler={binaries.built('kube-scheduler')}", "--", *extra]
    _, command = launch(monkeypatch, argv)
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    ran = yaml.safe_load(effective.read_text())
    assert [p["schedulerName"] for p in ran["profiles"]] == ["gpushare-scheduler"]
    assert ran["leaderElection"]["resourceName"] == "gpushare-scheduler"
    assert [e["urlPrefix"] for e in ran["extenders"]] == ["https://10.96.0.20:32766"] * 2
    assert {e["tlsConfig"]["serverName"] for e in ran["extenders"]} == {NAME}
