"""Settings shared by the components, and the flags they come from.

This sits below every component: a component imports its settings and :class:`UsageError` from here,
and :mod:`gpushare.cli` sits on top of the components.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from gpushare.contract.errors import ContractError
from gpushare.contract.names import ENV_NODE_NAME
from gpushare.contract.units import MemoryUnit, parse_unit
from gpushare.gpus.backend import DEFAULT_IGNORED_XIDS, DEFAULT_NVML_RECOVERY, InventoryError, parse_ignored_xids
from gpushare.memlimits.cgroups import V1, CgroupLayout, detect_layout, given_root

DEFAULT_DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
#: where /metrics, /healthz and /readyz listen unless told: they are plain HTTP, unauthenticated
DEFAULT_METRICS_HOST = "127.0.0.1"
#: how many members a gang may have unless the extender is told otherwise (its ``--max-gang-members``):
#: the work of a member's filter grows with its gang's size
MAX_GANG_MEMBERS = 1000


class UsageError(Exception):
    """A flag value that can't be used; printed as one line, exit code 2."""


def policy_name(text: str) -> str:
    """A ``--policy`` value (argparse type): one of the placement policies, refused before anything
    starts. The policies are imported only when the flag is given, which keeps ``--help`` fast."""
    from gpushare.placement import POLICIES

    if text not in POLICIES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(POLICIES)}")
    return text


@dataclass(frozen=True, slots=True)
class Reread:
    """How Allocate re-reads the node's pods from the API server before refusing.

    Kubelet learns of a pod from its own watch, and the plugin's watch cache can be behind it, so a
    miss in the cache is checked against the API server: at once, then ``attempts - 1`` more times
    after waits of ``first_wait`` seconds, doubling. The defaults give up after about 1.5 s.
    """

    attempts: int = 4
    first_wait: float = 0.1

    def waits(self) -> list[float]:
        """The pause before each re-read (none before the first)."""
        return [0.0 if i == 0 else self.first_wait * 2 ** (i - 1) for i in range(self.attempts)]


DEFAULT_REREAD = Reread()


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """The flags every node-side component shares, and the device plugin's own (their defaults for the
    other components, which don't read them)."""

    node_name: str
    kubeconfig: str | None
    gpus: str
    device_plugin_dir: Path
    memory_unit: MemoryUnit
    ignored_xids: frozenset[int]
    reread: Reread = DEFAULT_REREAD
    #: gpu-count replicas listed per card; 0: one per memory unit of the card (never runs out)
    count_replicas: int = 0
    #: seconds without a fault after which an NVML card that failed is trusted again
    nvml_recovery: float = DEFAULT_NVML_RECOVERY
    #: the cgroup v2 hierarchy the driver's memory limits partition; None: read from the mount table
    cgroup_root: Path | None = None
    #: why nothing on this node sets memory limits whatever the driver can do ("" when the CRI shim does)
    limits_off: str = ""

    def cgroup_layout(self) -> CgroupLayout:
        """The node's cgroup layout: ``--cgroup-root`` when given, else what this process's mounts show;
        with :attr:`limits_off`, none at all."""
        if self.limits_off:
            return CgroupLayout(V1, None, self.limits_off)
        mountinfo = Path("/proc/self/mountinfo").read_text()
        if self.cgroup_root is not None:
            return given_root(self.cgroup_root, mountinfo)
        return detect_layout(mountinfo)


def add_kubeconfig_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kubeconfig",
        default=None,
        metavar="FILE",
        help="default: the in-cluster configuration, then $KUBECONFIG or ~/.kube/config",
    )


def add_node_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of every node-side command: which node, which cards, how they are counted."""
    parser.add_argument("--node-name", default=os.environ.get(ENV_NODE_NAME), help="default: $NODE_NAME")
    add_kubeconfig_flag(parser)
    parser.add_argument("--gpus", default="nvml", help="'nvml' (default) or 'sim:COUNTxMODEL:MiB,...'")
    parser.add_argument("--memory-unit", default="GiB", help="GiB (default), MiB or <N>MiB")
    parser.add_argument(
        "--ignore-xids",
        default=",".join(str(x) for x in sorted(DEFAULT_IGNORED_XIDS)),
        help="XIDs that don't mark a card unhealthy (application errors)",
    )
    parser.add_argument(
        "--nvml-recovery-seconds",
        type=float,
        default=DEFAULT_NVML_RECOVERY,
        help="with --gpus nvml: seconds without a fault (and NVML answering again) before a card that hit a "
        f"critical XID or fell off the bus is advertised Healthy again (default {DEFAULT_NVML_RECOVERY:g})",
    )
    parser.add_argument(
        "--cgroup-root",
        default=None,
        metavar="DIR",
        help="the cgroup v2 hierarchy whose pod cgroups the driver's GPU memory limits apply to (default: "
        "/sys/fs/cgroup when this process's mount table shows cgroup v2 alone; on cgroup v1 or hybrid nodes "
        "limits are not enforced unless a cgroup2 mount is named here)",
    )


def add_device_plugin_flags(parser: argparse.ArgumentParser) -> None:
    """The flags only the device plugin reads (``gpushare device-plugin`` and ``gpushare node``)."""
    parser.add_argument(
        "--device-plugin-dir", default=DEFAULT_DEVICE_PLUGIN_DIR, help="where kubelet's registration socket is"
    )
    parser.add_argument(
        "--count-replicas",
        type=int,
        default=0,
        help="aliyun.com/gpu-count devices listed per card; 0 (default): one per memory unit of the card, "
        "so the node never runs out of gpu-count before its cards run out of memory",
    )
    parser.add_argument(
        "--allocate-rereads",
        type=int,
        default=DEFAULT_REREAD.attempts,
        help="times Allocate re-reads the node's pods from the API server before refusing (0: never)",
    )
    parser.add_argument(
        "--allocate-reread-wait",
        type=float,
        default=DEFAULT_REREAD.first_wait,
        help="seconds before the second re-read; doubles for each further one",
    )


def node_settings(args: argparse.Namespace) -> NodeSettings:
    """From :func:`add_node_flags`' flags."""
    if not args.node_name:
        raise UsageError("--node-name is required (or set $NODE_NAME)")
    if args.nvml_recovery_seconds < 0:
        raise UsageError("--nvml-recovery-seconds must not be negative")
    try:
        unit = parse_unit(args.memory_unit)
        ignored = parse_ignored_xids(args.ignore_xids)
    except (ContractError, InventoryError) as exc:
        raise UsageError(str(exc)) from None
    return NodeSettings(
        node_name=args.node_name,
        kubeconfig=args.kubeconfig,
        gpus=args.gpus,
        device_plugin_dir=Path(DEFAULT_DEVICE_PLUGIN_DIR),
        memory_unit=unit,
        ignored_xids=ignored,
        nvml_recovery=args.nvml_recovery_seconds,
        cgroup_root=Path(args.cgroup_root) if args.cgroup_root else None,
    )


def device_plugin_settings(args: argparse.Namespace) -> NodeSettings:
    """From :func:`add_node_flags`' and :func:`add_device_plugin_flags`' flags."""
    if min(args.allocate_rereads, args.allocate_reread_wait, args.count_replicas) < 0:
        raise UsageError("--allocate-rereads, --allocate-reread-wait and --count-replicas must not be negative")
    return dataclasses.replace(
        node_settings(args),
        device_plugin_dir=Path(args.device_plugin_dir),
        reread=Reread(args.allocate_rereads, args.allocate_reread_wait),
        count_replicas=args.count_replicas,
    )


@dataclass(frozen=True, slots=True)
class RewriteOptions:
    """What the CRI shim corrects besides env and annotations, and whether it blocks unrequested GPUs."""

    rewrite_devices: bool = False
    cdi: bool = False
    block_unrequested_gpu: bool = True


@dataclass(frozen=True, slots=True)
class ShimSettings:
    """The CRI shim's own flags."""

    listen: str
    runtime: str
    allow_api_fetch: bool
    options: RewriteOptions


def socket_path(address: str) -> Path:
    """``unix:///run/x.sock``, ``unix:/run/x.sock`` or a bare path."""
    for prefix in ("unix://", "unix:"):
        if address.startswith(prefix):
            address = address[len(prefix) :]
            break
    if not address.startswith("/"):
        raise ValueError(f"{address!r}: expected an absolute unix socket path")
    return Path(address)


def add_shim_flags(parser: argparse.ArgumentParser, *, listen: str, runtime: str) -> None:
    """The CRI shim's flags (``gpushare cri-shim`` and ``gpushare node``), with the command's defaults for
    the sockets."""
    parser.add_argument("--listen", default=listen, help="the socket kubelet connects to (mode 0600)")
    parser.add_argument("--runtime", default=runtime, help="the real runtime's CRI socket")
    api = parser.add_mutually_exclusive_group()
    api.add_argument(
        "--allow-api-fetch",
        dest="allow_api_fetch",
        action="store_true",
        default=True,
        help="read a pod from the API server when sandbox_config lacks its card assignment, and check cards "
        "for over-commit against the node's pods (default)",
    )
    api.add_argument(
        "--no-api-fetch",
        dest="allow_api_fetch",
        action="store_false",
        help="trust sandbox_config alone; containers without an assignment there are refused",
    )
    parser.add_argument(
        "--rewrite-devices",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also correct the /dev/nvidia* device nodes (for runtimes without the NVIDIA hook)",
    )
    parser.add_argument(
        "--cdi", action=argparse.BooleanOptionalAction, default=False, help="also correct CDI device names"
    )
    parser.add_argument(
        "--block-unrequested-gpu",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give containers that request no GPU NVIDIA_VISIBLE_DEVICES=void (default: on)",
    )


def shim_settings(args: argparse.Namespace) -> ShimSettings:
    """From :func:`add_shim_flags`' flags."""
    for flag, address in (("--listen", args.listen), ("--runtime", args.runtime)):
        try:
            socket_path(address)
        except ValueError as exc:
            raise UsageError(f"{flag} {exc}") from None
    return ShimSettings(
        listen=args.listen,
        runtime=args.runtime,
        allow_api_fetch=args.allow_api_fetch,
        options=RewriteOptions(
            rewrite_devices=args.rewrite_devices, cdi=args.cdi, block_unrequested_gpu=args.block_unrequested_gpu
        ),
    )


@dataclass(frozen=True, slots=True)
class MetricsEndpoint:
    """Where a component serves /metrics, /healthz and /readyz."""

    host: str
    port: int


def listen_address(text: str) -> str:
    """An IP address to listen on (argparse type)."""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an IP address (in a pod, pass the downward API's status.podIP)"
        ) from None


def add_metrics_host_flag(parser: argparse.ArgumentParser, flag: str = "--metrics-host") -> None:
    parser.add_argument(
        flag,
        type=listen_address,
        default=DEFAULT_METRICS_HOST,
        metavar="ADDRESS",
        help="address for /metrics, /healthz and /readyz, plain HTTP that anyone reaching it can read: "
        "in a pod, its IP from the downward API (status.podIP), so that kubelet's probes and Prometheus "
        "reach it and nothing else does; 0.0.0.0 only on purpose",
    )


def add_metrics_flags(parser: argparse.ArgumentParser, port: int) -> None:
    """``--metrics-port`` (0: off) and ``--metrics-host``."""
    parser.add_argument(
        "--metrics-port", type=int, default=port, help="port for /metrics, /healthz and /readyz (0: off)"
    )
    add_metrics_host_flag(parser)


def metrics_endpoint(args: argparse.Namespace) -> MetricsEndpoint | None:
    """From :func:`add_metrics_flags`' flags; None when off."""
    if not 0 <= args.metrics_port <= 65535:
        raise UsageError(f"--metrics-port {args.metrics_port} is not a port (0-65535; 0: off)")
    return MetricsEndpoint(args.metrics_host, args.metrics_port) if args.metrics_port else None
