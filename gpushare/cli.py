"""The ``gpushare`` command: one subcommand per component, on top of them all.

Each subcommand lives in its component's small ``cmd`` module exposing ``add_arguments(parser)`` and
``run(args) -> int``. Those modules import little at the top and pull in their component inside
``run``, so ``gpushare --help`` stays fast and one component's dependencies never break another.
"""

from __future__ import annotations

import argparse
import logging
import sys
from types import ModuleType
from typing import NoReturn

from gpushare import node
from gpushare.advertiser import cmd as advertiser_cmd
from gpushare.crishim import cmd as crishim_cmd
from gpushare.deviceplugin import cmd as deviceplugin_cmd
from gpushare.extender import cmd as extender_cmd
from gpushare.extender import kubescheduler as kube_scheduler_cmd
from gpushare.gpus.backend import InventoryError
from gpushare.inspection import cmd as inspect_cmd
from gpushare.kube.errors import KubeError
from gpushare.process import interrupt_on_sigint
from gpushare.sandbox import apiserver_cmd
from gpushare.sandbox import cmd as sandbox_cmd
from gpushare.settings import UsageError
from gpushare.simulate import cmd as simulate_cmd
from gpushare.webhook import cmd as webhook_cmd

SUBCOMMANDS: dict[str, tuple[ModuleType, str]] = {
    "device-plugin": (deviceplugin_cmd, "serve aliyun.com/gpu-mem and aliyun.com/gpu-count to kubelet"),
    "cri-shim": (crishim_cmd, "proxy CRI between kubelet and containerd, enforcing card assignments"),
    "advertiser": (advertiser_cmd, "publish this node's card inventory as a node annotation"),
    "extender": (extender_cmd, "serve the kube-scheduler extender (filter, prioritize, bind, preempt)"),
    "kube-scheduler": (kube_scheduler_cmd, "run kube-scheduler, its extender entries made reachable from its pod"),
    "webhook": (webhook_cmd, "serve the admission webhook guarding gpushare's pod annotations"),
    "node": (node, "run advertiser, device plugin and CRI shim in one process"),
    "sandbox": (sandbox_cmd, "run a whole simulated cluster on this machine"),
    "inspect": (inspect_cmd, "show per-card GPU allocation across the cluster"),
    "apiserver": (apiserver_cmd, "serve the Kubernetes API stand-in"),
    "simulate": (simulate_cmd, "replay a cluster's GPU pods under placement policies (what-if)"),
}


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def log_level(text: str) -> int:
    """A ``--log-level`` value (argparse type), any case."""
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return logging.getLevelName(text.upper())


def configure_logging(level: int) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless it names the default itself or there is none to
    show (no default, an empty one, or an on/off flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or not action.option_strings
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or default in ("", [])
        ):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """A flag that can't be used is refused in one line, before anything starts, with exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="gpushare", description="Share GPUs between Kubernetes pods by memory.", formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--log-level",
        type=log_level,
        default="info",
        metavar="{" + ",".join(LOG_LEVELS) + "}",
        help="what is logged, before the command",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        sub_parser.set_defaults(run=module.run)
        module.add_arguments(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    interrupt_on_sigint()  # every long-running command stops on Ctrl-C, from its first line on
    try:
        return int(args.run(args))
    except (UsageError, InventoryError, KubeError) as exc:
        print(f"gpushare {args.command}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    except KeyboardInterrupt:
        return 130


def kubectl_main() -> int:
    """``kubectl gpushare [-d] [NODE]``: the inspect subcommand as a kubectl plugin."""
    return main(["inspect", *sys.argv[1:]])


def kubectl_inspect_main(argv: list[str] | None = None) -> int:
    """``kubectl inspect gpushare [-d] [NODE]``: the original plugin's name and, by default, its layout."""
    return main(["inspect", "--layout", "original", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
