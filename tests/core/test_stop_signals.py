"""SIGINT stops the ``gpushare`` commands even when it was inherited ignored, as by a job started with
``cmd &`` from a script: Python installs its KeyboardInterrupt handler only when SIGINT was not ignored at
start, so each command installs it itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_with_sigint_ignored(code: str) -> subprocess.CompletedProcess[str]:
    script = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


def test_the_gpushare_command_stops_on_sigint_from_its_start() -> None:
    """A command interrupted before it reaches its own wait (while starting up) exits with 130."""
    proc = run_with_sigint_ignored(
        """
        import argparse, os, sys
        from gpushare import cli

        class Starting:
            @staticmethod
            def add_arguments(parser: argparse.ArgumentParser) -> None:
                pass

            @staticmethod
            def run(args: argparse.Namespace) -> int:
                os.kill(os.getpid(), signal.SIGINT)  # os.kill runs a handler for its own process at once
                return 0

        cli.SUBCOMMANDS["starting"] = (Starting, "a command still starting up")
        sys.exit(cli.main(["starting"]))
        """
    )
    assert proc.returncode == 130, proc.stderr


def test_within_signals_raise_sigint_raises_keyboard_interrupt_and_is_ignored_again_after() -> None:
    proc = run_with_sigint_ignored(
        """
        import os
        from gpushare.process import signals_raise

        try:
            with signals_raise():
                os.kill(os.getpid(), signal.SIGINT)
            print("not interrupted")
        except KeyboardInterrupt:
            print("interrupted")
        print("restored" if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else "not restored")
        """
    )
    assert proc.stdout.split() == ["interrupted", "restored"], proc.stderr
