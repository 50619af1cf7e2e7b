"""``gpushare kube-scheduler``: start kube-scheduler with its extender entries pointing where it can reach.

The chart's kube-scheduler Deployment mounts a ``KubeSchedulerConfiguration`` whose extender entries name
the extender's Service by its cluster DNS name (``https://gpushare-extender.<namespace>.svc:32766``). Where
that name resolves, the file is used as it is. Where it doesn't (a cluster without cluster DNS, or a pod
whose resolver can't reach it), each such entry gets the Service's ClusterIP instead, read from the
variables kubelet gives every container for the Services of its namespace that existed when its pod was
created (``GPUSHARE_EXTENDER_SERVICE_HOST`` and ``_PORT``: kubelet's pkg/kubelet/envvars writes them for
each Service, its name upper-cased with ``-`` as ``_``); the entry's ``tlsConfig.serverName`` stays (or is
set to) the DNS name, so the extender's certificate is still checked against the name it was issued for.
The configuration is written to ``--write-config`` and this process becomes kube-scheduler (``exec``), so
kubelet's signals and the container's exit code are kube-scheduler's own.

Done here rather than with a ``hostAliases`` entry or a fixed ClusterIP in the chart: neither the
Service's address nor whether cluster DNS works is known when the chart is rendered.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from gpushare.contract.names import service_env_prefix
from gpushare.settings import UsageError

#: where the chart mounts the configuration, and where the written one goes (the Deployment's emptyDir)
DEFAULT_CONFIG = "/etc/gpushare/kube-scheduler/config.yaml"
DEFAULT_WRITE_CONFIG = "/tmp/kube-scheduler.yaml"
#: kube-scheduler in the gpushare image (gpushare/sandbox/image.py puts it there)
DEFAULT_KUBE_SCHEDULER = "/usr/local/bin/kube-scheduler"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="the KubeSchedulerConfiguration to start from")
    parser.add_argument(
        "--write-config", default=DEFAULT_WRITE_CONFIG, help="where the configuration kube-scheduler reads is written"
    )
    parser.add_argument("--kube-scheduler", default=DEFAULT_KUBE_SCHEDULER, help="the kube-scheduler binary")
    parser.add_argument(
        "scheduler_args",
        nargs=argparse.REMAINDER,
        metavar="KUBE_SCHEDULER_FLAGS",
        help="kube-scheduler's own flags, after --, passed on as they are (--config is this command's)",
    )


def resolves(host: str) -> bool:
    """Whether this machine's resolver has an address for ``host``."""
    try:
        return bool(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, UnicodeError):
        return False


def service_name(host: str) -> str | None:
    """The Service a cluster DNS name names (``<service>.<namespace>.svc[.<cluster domain>]``), else None."""
    labels = host.rstrip(".").split(".")
    return labels[0] if len(labels) >= 3 and labels[2] == "svc" else None


def service_address(service: str, env: Mapping[str, str]) -> tuple[str, str]:
    """The ClusterIP and first port of ``service``, from the variables kubelet set for it."""
    prefix = service_env_prefix(service)
    host, port = env.get(f"{prefix}_SERVICE_HOST", ""), env.get(f"{prefix}_SERVICE_PORT", "")
    absent = [name for name, value in ((f"{prefix}_SERVICE_HOST", host), (f"{prefix}_SERVICE_PORT", port)) if not value]
    if absent:
        raise UsageError(
            f"{' and '.join(absent)} not set: kubelet sets them only in pods created after the Service {service} "
            "in their own namespace, and not with enableServiceLinks: false"
        )
    return host, port


def reachable(config: Mapping[str, Any], env: Mapping[str, str], resolves: Callable[[str], bool] = resolves) -> dict:
    """``config`` with each extender entry whose host doesn't resolve sent to its Service's ClusterIP
    (and the port its URL names, else the Service's first), ``tlsConfig.serverName`` kept on the name."""
    config = copy.deepcopy(dict(config))
    for entry in config.get("extenders") or []:
        url = urlsplit(entry.get("urlPrefix") or "")
        if not url.hostname:
            raise UsageError(f"an extender entry's urlPrefix {entry.get('urlPrefix')!r} names no host")
        if resolves(url.hostname):
            continue
        service = service_name(url.hostname)
        if service is None:
            raise UsageError(f"the extender's host {url.hostname} does not resolve here, and names no Service")
        try:
            host, port = service_address(service, env)
        except UsageError as exc:
            raise UsageError(f"{url.hostname} does not resolve here (no cluster DNS?), and {exc}") from None
        address = f"[{host}]" if ":" in host else host
        entry["urlPrefix"] = urlunsplit(url._replace(netloc=f"{address}:{url.port or port}"))
        if entry.get("enableHTTPS"):
            entry["tlsConfig"] = {"serverName": url.hostname, **(entry.get("tlsConfig") or {})}
    return config


class _NoAliases(yaml.SafeDumper):
    """Each entry written out in full: the shipped file shares one tlsConfig between entries (a YAML
    alias), which stays readable when each entry carries its own copy."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def run(args: argparse.Namespace) -> int:
    source = Path(args.config)
    try:
        template = yaml.safe_load(source.read_text())
    except OSError as exc:
        raise UsageError(f"can't read the kube-scheduler configuration {source}: {exc.strerror}") from None
    if not isinstance(template, dict):
        raise UsageError(f"{source} holds no KubeSchedulerConfiguration")
    binary = shutil.which(args.kube_scheduler)
    if binary is None:
        raise UsageError(f"no kube-scheduler binary at {args.kube_scheduler}")
    config = reachable(template, os.environ)
    target = Path(args.write_config)
    target.write_text(yaml.dump(config, Dumper=_NoAliases, sort_keys=False))
    passed = args.scheduler_args[1:] if args.scheduler_args[:1] == ["--"] else args.scheduler_args
    os.execv(binary, [binary, f"--config={target}", *passed])
    return 0  # not reached: execv replaces this process
