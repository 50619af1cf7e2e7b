"""The extender's /metrics at scale: the per-card gauges follow the cache a node at a time (a scrape
writes again only the nodes that changed since the last), scrapers that come together or too often
share one render, and the health port serves the same body as the verbs' port."""

from __future__ import annotations

import threading
import urllib.request
from typing import Any

import pytest
from gpushare.extender.metrics import CardGauges
from gpushare.extender.wiring import Serving, start_extender
from kubernetes import client
from podfactory import container, gpu_pod
from support.extender import Cluster
from support.waiting import wait_until

from gpushare.observability import Exposition
from gpushare.settings import MetricsEndpoint


def samples(text: bytes, node: str) -> dict[tuple[str, str], float]:
    """(gauge, card) -> value for ``node``'s cards."""
    found = {}
    for line in text.decode().splitlines():
        if line.startswith("#") or f'node="{node}"' not in line:
            continue
        name, rest = line.split("{", 1)
        labels, value = rest.rsplit("} ", 1)
        card = labels.split('card="', 1)[1].split('"', 1)[0]
        found[(name.removeprefix("gpushare_extender_card_"), card)] = float(value)
    return found


def test_card_gauges_follow_the_cache_writing_again_only_the_nodes_that_changed(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = cluster.extender.cache
    gauges = CardGauges(cache)
    viewed: list[str] = []
    view = cache.view
    scraper = threading.current_thread()

    def counted(node: str) -> Any:
        if threading.current_thread() is scraper:
            viewed.append(node)
        return view(node)

    monkeypatch.setattr(cache, "view", counted)
    first = gauges.exposition()
    assert first.count(b"# TYPE gpushare_extender_card_allocated_units gauge\n") == 1
    assert samples(first, "n1") == {
        **{("total_units", card): units for card, units in (("0", 80.0), ("1", 80.0), ("2", 15.0))},
        **{("allocated_units", card): 0.0 for card in "012"},
    }
    assert samples(first, "n2") == {("total_units", "0"): 24.0, ("allocated_units", "0"): 0.0}
    assert sorted(viewed) == ["n1", "n2"]

    viewed.clear()
    assert gauges.exposition() == first and viewed == []  # nothing changed: nothing written again

    pod = cluster.pod(gpu_pod("p", [container("main", 4)]))
    assert cluster.bind(pod, "n1")["Error"] == ""
    wait_until(
        lambda: sum(v for (g, _), v in samples(gauges.exposition(), "n1").items() if g == "allocated_units") == 4,
        what="the bind in the gauges",
    )
    assert set(viewed) == {"n1"}  # n2 did not change

    cluster.core.delete_node("n2")
    wait_until(lambda: not samples(gauges.exposition(), "n2"), what="the deleted node's gauges gone")
    assert samples(gauges.exposition(), "n1")


def test_scrapers_that_come_together_share_one_render() -> None:
    rendering, release = threading.Event(), threading.Event()
    renders: list[int] = []

    def render() -> bytes:
        renders.append(1)
        rendering.set()
        assert release.wait(30)
        return f"render {len(renders)}\n".encode()

    metrics = Exposition(render, max_age=3600)
    bodies: list[bytes] = []
    scrapers = [threading.Thread(target=lambda: bodies.append(metrics())) for _ in range(4)]
    for scraper in scrapers:
        scraper.start()
    assert rendering.wait(30)
    release.set()
    for scraper in scrapers:
        scraper.join(30)
    assert bodies == [b"render 1\n"] * 4 and metrics() == b"render 1\n"
    assert len(renders) == 1

    fresh = Exposition(render, max_age=0)
    assert fresh() == b"render 2\n" and fresh() == b"render 3\n"


def test_the_health_port_serves_the_card_gauges_and_the_verbs_timings(
    cluster: Cluster, kube_api: client.ApiClient
) -> None:
    serving = Serving(0, host="127.0.0.1", health=MetricsEndpoint("127.0.0.1", 0))
    extender = start_extender(kube_api, 0, "binpack", serving=serving)
    try:
        assert extender.health is not None
        card = b'gpushare_extender_card_total_units{card="2",model="T4",node="n1"} 15.0\n'

        def scraped() -> bytes | None:
            with urllib.request.urlopen(f"http://127.0.0.1:{extender.health.port}/metrics", timeout=5) as reply:
                body = reply.read()
            return body if card in body else None

        body = wait_until(scraped, what="the cards on the health port")
        assert b"gpushare_extender_verb_seconds" in body
    finally:
        extender.stop()
