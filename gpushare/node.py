"""``gpushare node``: the advertiser, the device plugin and the enforcement of card assignments (the NRI
plugin by default, or the CRI shim: ``--enforcement``) in one process, as the DaemonSet runs them. They
share one card inventory, so a health event reaches all three at once, and one watch of the node's pods
and one Event writer (:class:`gpushare.kube.nodeapi.NodeApi`), so a node costs the API server one pod
watch. Each runs under :mod:`gpushare.supervisor`, which restarts one that dies (its docstring says why
that beats exiting) and keeps ``/readyz`` false while one is down; the shared watch is supervised too,
started first and stopped last, so a component's restart keeps it."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from gpushare.advertiser.deviceorder import DRA_ORDERS, ORDER_INDEX
from gpushare.contract.names import NRI_SOCKET
from gpushare.gpus.split import ALL_CARDS, EVERY_CARD, DraCards
from gpushare.settings import add_device_plugin_flags, add_metrics_flags, add_node_flags, add_shim_flags

if TYPE_CHECKING:
    from pathlib import Path

    from gpushare.draplugin.server import PluginPaths
    from gpushare.gpus.backend import GpuBackend
    from gpushare.kube.nodeapi import NodeApi
    from gpushare.nriplugin.wiring import NriSettings
    from gpushare.settings import NodeSettings, ShimSettings
    from gpushare.supervisor import Supervised, Supervisor

#: what deploy/node-agent.yaml runs: the CRI shim's sockets, and where its probes and Prometheus look
DEFAULT_LISTEN = "unix:///run/gpushare/cri.sock"
DEFAULT_RUNTIME = "unix:///run/containerd/containerd.sock"
DEFAULT_METRICS_PORT = 9410
#: the component that holds the node's pod watch and Event writer
NODE_API = "node-api"
#: the values of --enforcement
ENFORCE_NRI = "nri"
ENFORCE_CRI_SHIM = "cri-shim"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_node_flags(parser)
    add_device_plugin_flags(parser)
    add_shim_flags(parser, listen=DEFAULT_LISTEN, runtime=DEFAULT_RUNTIME)
    add_metrics_flags(parser, DEFAULT_METRICS_PORT)
    parser.add_argument("--no-cri-shim", action="store_true", help="run only the advertiser and the device plugin")
    parser.add_argument(
        "--enforcement",
        choices=(ENFORCE_NRI, ENFORCE_CRI_SHIM),
        default=ENFORCE_NRI,
        help="how containers are held to their cards and limits: as an NRI plugin of containerd (nri, the "
        "default: kubelet is left as it is) or as a CRI shim kubelet is pointed at (cri-shim)",
    )
    parser.add_argument("--nri-socket", default=NRI_SOCKET, help="containerd's NRI socket (with --enforcement=nri)")
    parser.add_argument(
        "--detach-cri-shim",
        metavar="CGROUPS",
        default=None,
        help="run the CRI shim as a process of its own that outlives the agent's container, so that kubelet "
        "can still start containers (this agent's included) while the agent is down or upgraded; CGROUPS: "
        "where the host's cgroup hierarchies are mounted (the shim leaves the agent's cgroup for one of its "
        "own there). Needs the pod privileged and in the host's PID namespace (docs/operations.md)",
    )
    parser.add_argument("--advertise-interval", type=float, default=60.0, help="seconds between inventory re-checks")
    parser.add_argument(
        "--dra",
        action="store_true",
        help="also serve kubelet's DRA plugin of driver gpu.gpushare.io (prepares ResourceClaims as CDI specs)",
    )
    parser.add_argument(
        "--dra-cards",
        default=ALL_CARDS,
        help="with --dra: the cards the DRA driver offers, 'all' (default) or NVML indexes / UUIDs separated by "
        "commas; the others stay with the device plugin and the extender (a card is offered one way at a time)",
    )
    parser.add_argument(
        "--dra-order",
        choices=DRA_ORDERS,
        default=ORDER_INDEX,
        help="with --dra: the order of the devices in the node's ResourceSlice, which kube-scheduler's first fit "
        "follows: index (NVML index, the default) or best-fit (least free memory first, rewritten as claims "
        "are allocated and released; watches every ResourceClaim)",
    )
    parser.add_argument("--kubelet-root", default="/var/lib/kubelet", help="kubelet's --root-dir (with --dra)")
    parser.add_argument("--cdi-dir", default="/var/run/cdi", help="where containerd reads CDI specs (with --dra)")


def components(
    settings: NodeSettings,
    shim: ShimSettings | None,
    backend: GpuBackend,
    shared: NodeApi,
    advertise_interval: float,
    dra: PluginPaths | None = None,
    dra_cards: DraCards = EVERY_CARD,
    detach: Path | None = None,
    nri: NriSettings | None = None,
    dra_order: str = ORDER_INDEX,
) -> list[Supervised]:
    """The node agent's components, each as a way to start it afresh; ``shared`` first. With ``dra``
    the DRA kubelet plugin and the ResourceSlice too, its sockets under ``dra.kubelet_root``: they get
    the cards ``dra_cards`` picks, the advertiser and the device plugin the others (see
    :mod:`gpushare.gpus.split`). The CRI shim sees every card: it enforces both ways. With ``detach``
    (where the host's cgroups are mounted) the CRI shim runs outside the agent's container
    (:mod:`gpushare.crishim.handover`). With ``nri`` the decision the CRI shim takes is taken by the NRI
    plugin instead (:mod:`gpushare.nriplugin`), and no CRI shim runs."""
    from gpushare.advertiser.agent import Advertiser
    from gpushare.advertiser.slices import SlicePublisher
    from gpushare.crishim.handover import start_detached_shim
    from gpushare.crishim.wiring import start_cri_shim
    from gpushare.deviceplugin.wiring import start_device_plugin
    from gpushare.draplugin.wiring import start_dra_plugin
    from gpushare.gpus.split import split_cards
    from gpushare.nriplugin.wiring import start_nri_plugin
    from gpushare.supervisor import Supervised

    plugin_cards, dra_owned = split_cards(backend, dra_cards) if dra is not None else (backend, None)

    def start_advertiser() -> Advertiser:
        advertiser = Advertiser(shared.api, settings.node_name, plugin_cards, settings.memory_unit, advertise_interval)
        advertiser.start()
        return advertiser

    found = [
        Supervised(NODE_API, shared.start),
        Supervised("advertiser", start_advertiser),
        Supervised("device-plugin", lambda: start_device_plugin(settings, plugin_cards, shared.api, shared)),
    ]
    if shim is not None and nri is not None:
        plugin = nri
        found.append(
            Supervised("nri-plugin", lambda: start_nri_plugin(settings, shim, plugin, backend, shared.api, shared))
        )
    elif shim is not None and detach is not None:
        found.append(Supervised("cri-shim", lambda: start_detached_shim(settings, shim, detach)))
    elif shim is not None:
        found.append(Supervised("cri-shim", lambda: start_cri_shim(settings, shim, backend, shared.api, shared)))
    if dra is not None and dra_owned is not None:
        owned = dra_owned

        def start_slice_publisher() -> SlicePublisher:
            unit, interval = settings.memory_unit, advertise_interval
            publisher = SlicePublisher(shared.api, settings.node_name, owned, unit, interval, order=dra_order)
            publisher.start()
            return publisher

        found.append(Supervised("resourceslice", start_slice_publisher))
        found.append(Supervised("dra-plugin", lambda: start_dra_plugin(settings, dra, owned, shared.api)))
    return found


#: a card's memory limits when the node agent runs without its CRI shim
NO_SHIM_LIMITS = "the node agent runs without its CRI shim (--no-cri-shim), which is what sets the limits"


def run(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from gpushare.contract.names import NRI_PLUGIN_INDEX, NRI_PLUGIN_NAME
    from gpushare.draplugin.server import PluginPaths
    from gpushare.gpus.split import parse_dra_cards
    from gpushare.kube.nodeapi import NodeApi
    from gpushare.kube.transport import load_api
    from gpushare.nodewiring import run_on_node
    from gpushare.nriplugin.wiring import NriSettings
    from gpushare.settings import UsageError, device_plugin_settings, metrics_endpoint, shim_settings
    from gpushare.supervisor import Supervisor

    log = logging.getLogger("gpushare.node")
    metrics = metrics_endpoint(args)
    settings = device_plugin_settings(args)
    shim = None if args.no_cri_shim else shim_settings(args)
    if shim is None:  # the CRI shim is what sets the limits: without it the cards must not claim them
        settings = dataclasses.replace(settings, limits_off=NO_SHIM_LIMITS)
    dra = PluginPaths(Path(args.kubelet_root), Path(args.cdi_dir)) if args.dra else None
    if args.dra_cards != ALL_CARDS and dra is None:
        raise UsageError("--dra-cards picks the cards the DRA driver offers: it needs --dra")
    if args.dra_order != ORDER_INDEX and dra is None:
        raise UsageError("--dra-order orders the DRA driver's ResourceSlice: it needs --dra")
    dra_cards = parse_dra_cards(args.dra_cards)
    detach = Path(args.detach_cri_shim) if args.detach_cri_shim else None
    nri = NriSettings(args.nri_socket, NRI_PLUGIN_NAME, NRI_PLUGIN_INDEX) if args.enforcement == ENFORCE_NRI else None
    if nri is not None and detach is not None:
        raise UsageError("--detach-cri-shim runs the CRI shim: it needs --enforcement=cri-shim")

    enforcing = "off" if shim is None else f"NRI plugin on {nri.socket}" if nri else f"CRI shim on {shim.listen}"

    def start(backend: GpuBackend) -> Supervisor:
        shared = NodeApi(load_api(settings.kubeconfig), settings.node_name)
        found = components(
            settings, shim, backend, shared, args.advertise_interval, dra, dra_cards, detach, nri, args.dra_order
        )
        supervisor = Supervisor(found)
        supervisor.start()
        log.info(
            "node agent for %s: %d card(s), enforcement %s, DRA plugin %s",
            settings.node_name,
            len(backend.cards()),
            enforcing,
            "off" if dra is None else f"on {dra.dra_socket}",
        )
        return supervisor

    return run_on_node("node agent", settings, metrics, start)
