"""``gpushare COMMAND --help``: each command lists exactly the flags it reads, each with its default,
and a bad ``--log-level`` stops the command at parse time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpushare.cli import main

NODE = {
    "--node-name",
    "--kubeconfig",
    "--gpus",
    "--memory-unit",
    "--ignore-xids",
    "--nvml-recovery-seconds",
    "--cgroup-root",
}
DEVICE_PLUGIN = {"--device-plugin-dir", "--count-replicas", "--allocate-rereads", "--allocate-reread-wait"}
SHIM = {
    "--listen",
    "--runtime",
    "--allow-api-fetch",
    "--no-api-fetch",
    "--rewrite-devices",
    "--no-rewrite-devices",
    "--cdi",
    "--no-cdi",
    "--block-unrequested-gpu",
    "--no-block-unrequested-gpu",
}
METRICS = {"--metrics-port", "--metrics-host"}
HELP = {"-h", "--help"}

FLAGS = {
    "advertiser": HELP | NODE | {"--once", "--interval"},
    "device-plugin": HELP | NODE | DEVICE_PLUGIN | METRICS,
    "cri-shim": HELP | NODE | SHIM | METRICS,
    "node": HELP
    | NODE
    | DEVICE_PLUGIN
    | SHIM
    | METRICS
    | {"--no-cri-shim", "--advertise-interval", "--dra", "--dra-cards", "--dra-order", "--kubelet-root", "--cdi-dir"}
    | {"--enforcement", "--nri-socket", "--detach-cri-shim"},
    "extender": HELP
    | {"--port", "--kubeconfig", "--policy", "--host", "--health-port", "--health-host", "--max-gang-members"}
    | {"--dra-steering", "--node-agent-namespace"}
    | {"--tls-cert", "--tls-key", "--client-ca", "--no-client-auth", "--max-body-bytes", "--read-timeout", "--workers"},
    "webhook": HELP | {"--port", "--host", "--tls-cert", "--tls-key", "--client-ca", "--trusted-user"},
    "kube-scheduler": HELP | {"--config", "--write-config", "--kube-scheduler"},
}

#: defaults a reader looks for: ports, listen addresses, the runtime
SHOWN = {
    "node": {
        "--metrics-port": "9410",  # where deploy/node-agent.yaml's probes look
        "--metrics-host": "127.0.0.1",
        "--listen": "unix:///run/gpushare/cri.sock",
        "--runtime": "unix:///run/containerd/containerd.sock",
        "--nri-socket": "/var/run/nri/nri.sock",
    },
    "cri-shim": {"--metrics-port": "9446", "--runtime": "unix:///run/containerd/containerd.sock"},
    "device-plugin": {"--metrics-port": "9445", "--device-plugin-dir": "/var/lib/kubelet/device-plugins"},
    "extender": {"--port": "32766", "--health-host": "127.0.0.1", "--read-timeout": "10.0"},
    "webhook": {"--port": "8443", "--host": "0.0.0.0"},
}


def help_of(command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Each flag in the options of ``gpushare COMMAND --help``, with the help text beside it."""
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    flags: dict[str, str] = {}
    names: list[str] = []
    for line in capsys.readouterr().out.splitlines():
        if m := re.match(r"^  (-\S.*?)(?:  +(.*))?$", line):
            names = [invocation.split(" ")[0] for invocation in m[1].split(", ")]
            flags.update(dict.fromkeys(names, m[2] or ""))
        elif line.startswith("   ") and names:  # the help went on the next line
            flags.update({name: f"{flags[name]} {line.strip()}".strip() for name in names})
        else:
            names = []
    return flags


@pytest.mark.parametrize("command", list(FLAGS))
def test_help_lists_exactly_the_flags_the_command_reads(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert set(help_of(command, capsys, monkeypatch)) == FLAGS[command]


@pytest.mark.parametrize("command", list(SHOWN))
def test_help_shows_the_defaults_of_ports_addresses_and_the_runtime(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    flags = help_of(command, capsys, monkeypatch)
    for flag, default in SHOWN[command].items():
        assert f"(default: {default})" in flags[flag], (flag, flags[flag])


def test_help_names_the_log_levels_and_kubeconfig_names_its_environment_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "$KUBECONFIG" in help_of("node", capsys, monkeypatch)["--kubeconfig"]
    assert "$KUBECONFIG" in help_of("extender", capsys, monkeypatch)["--kubeconfig"]
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--log-level {debug,info,warning,error,critical}" in capsys.readouterr().out


def test_a_bad_log_level_stops_the_command_before_anything_starts(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"  # the API stand-in writes it once it serves
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpushare.cli",
            "--log-level",
            "nope",
            "apiserver",
            "--port",
            "0",
            "--kubeconfig-out",
            str(kubeconfig),
        ],
        capture_output=True,
        text=True,
        timeout=60,  # the stand-in, had it started, would serve until stopped
    )
    assert done.returncode == 2
    assert "argument --log-level: 'nope' is not one of debug, info, warning, error, critical" in done.stderr
    assert not kubeconfig.exists()
