"""Kubernetes access through the official client.

Objects are handled as the plain JSON dicts the API returns (``_preload_content=False``), which is
several times faster than the client's model classes and keeps unknown fields intact. Every failure
is mapped to a :class:`~gpushare.kube.errors.KubeError` subclass whose message names the object.

- :mod:`~gpushare.kube.errors`: the error classes (no third-party imports, so the CLI can catch them cheaply);
- :mod:`~gpushare.kube.transport`: building the client, and one call through it with errors translated;
- :mod:`~gpushare.kube.retry`: back-off, and retrying through conflicts and outages;
- :mod:`~gpushare.kube.objects`: reading and writing pods, nodes and bindings;
- :mod:`~gpushare.kube.events`: the one Event recorder (background, deduplicating);
- :mod:`~gpushare.kube.watch`: the LIST-then-WATCH cache.
"""
