"""The NRI plugin as the node agent runs it (``gpushare node --enforcement=nri``): its own thread and loop,
registered as ``10-gpushare``, ready once the runtime configured it, and connecting again after the
runtime went away; in nri mode the agent runs no CRI shim."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from gpushare.nriplugin.handler import EVENTS
from gpushare.nriplugin.session import event_mask
from gpushare.nriplugin.wiring import NriSettings, RunningPlugin, start_nri_plugin
from support.nriruntime import fake_runtime

from gpushare.contract.names import NRI_PLUGIN_INDEX, NRI_PLUGIN_NAME
from gpushare.contract.units import GIB
from gpushare.gpus.simulated import SimulatedBackend
from gpushare.node import components
from gpushare.settings import NodeSettings, RewriteOptions, ShimSettings

BACKEND = SimulatedBackend("n1", "1xT4:15360")
NODE = NodeSettings(
    node_name="n1",
    kubeconfig=None,
    gpus="sim:1xT4:15360",
    device_plugin_dir=Path("/nonexistent"),
    memory_unit=GIB,
    ignored_xids=frozenset(),
)
SHIM = ShimSettings(
    listen="unix:///unused.sock", runtime="unix:///unused.sock", allow_api_fetch=False, options=RewriteOptions()
)


@pytest.fixture
def socket_path() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="nri", dir="/tmp"))  # unix socket paths must stay short
    yield directory / "nri.sock"
    shutil.rmtree(directory, ignore_errors=True)


async def until(condition: object, what: str, timeout: float = 10.0) -> None:
    """Wait for ``condition()`` (checked from this loop while the plugin's thread works) up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_the_plugin_registers_as_gpushare_and_is_ready_once_configured_and_comes_back(socket_path: Path) -> None:
    async def scenario() -> None:
        running: RunningPlugin | None = None
        try:
            async with fake_runtime(socket_path) as runtime:
                running = start_nri_plugin(
                    NODE, SHIM, NriSettings(str(socket_path), NRI_PLUGIN_NAME, NRI_PLUGIN_INDEX), BACKEND, None, None
                )
                first = await runtime.accept()
                registered = first.registered.result()
                assert (registered.plugin_name, registered.plugin_idx) == ("gpushare", "10")
                assert running.alive() and not running.ready()
                assert await first.configure() == event_mask(EVENTS)
                await until(running.ready, "the plugin ready")
                await first.close()  # containerd restarting
                again = await runtime.accept()
                assert again.registered.result().plugin_name == "gpushare"
        finally:
            if running is not None:
                await asyncio.to_thread(running.stop)
                assert not running.alive()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_in_nri_mode_the_agent_runs_the_plugin_and_no_cri_shim() -> None:
    nri = NriSettings("/run/nri.sock", NRI_PLUGIN_NAME, NRI_PLUGIN_INDEX)
    shared = SimpleNamespace(api=None, start=None)  # nothing is started here
    names = [c.name for c in components(NODE, SHIM, BACKEND, shared, 60.0, nri=nri)]  # type: ignore[arg-type]
    assert "nri-plugin" in names and "cri-shim" not in names
    assert "cri-shim" in [c.name for c in components(NODE, SHIM, BACKEND, shared, 60.0)]  # type: ignore[arg-type]
