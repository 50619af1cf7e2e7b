"""What gpushare.tlshttp's server adds to each request: a handler that answers at once, called over one
keep-alive connection (as kube-scheduler calls the extender), in plain HTTP and in TLS with a client
certificate; the median and p99 per request, for a small body and for one the size of 5,000 node names.

    python benchmarks/http_overhead.py [--requests 2000] [--rounds 5] [--against OLD_TLSHTTP.py]

Each server runs in a process of its own, as the extender does, so that the client doesn't compete with it
for the GIL. ``--against`` measures another version of the module in the same run, round by round in turn
with this one, so that the machine's noise falls on both alike; for example the version of a commit:
``git show <commit>:gpushare/tlshttp.py > /tmp/old_tlshttp.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.util
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from gpushare import tlshttp
from gpushare.sandbox.certs import Certs, make_certs

#: request bodies: about a filter call's pod, and the pod with 5,000 node names
BODIES = {"1 KiB": b"x" * 1024, "64 KiB": b"x" * (64 << 10)}
THIS = "this"


def load(path: str) -> ModuleType:
    """gpushare.tlshttp (``this``), or the version of it at ``path``."""
    if path == THIS:
        return tlshttp
    spec = importlib.util.spec_from_file_location("tlshttp_against", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the module's dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def serve(module_path: str, tls_files: list[str]) -> None:
    """Serve until stdin closes, after printing the port."""
    module = load(module_path)
    tls = module.ServerTLS(*tls_files) if tls_files else None
    server = module.HttpServer("127.0.0.1", 0, lambda request: module.Reply(200, b'{"Error": ""}'), tls=tls)
    server.start()
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop()


@contextlib.contextmanager
def serving(module_path: str, certs: Certs | None) -> Iterator[int]:
    """A server of the module at ``module_path`` in a process of its own; its port."""
    tls = ["--tls", certs.server.cert, certs.server.key, certs.ca] if certs is not None else []
    argv = [sys.executable, __file__, "--serve", module_path, *tls]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            yield int(proc.stdout.readline())
        finally:
            proc.stdin.close()
            proc.wait(30)


def connect(port: int, certs: Certs | None) -> http.client.HTTPConnection:
    if certs is None:
        return http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    context = ssl.create_default_context(cafile=certs.ca)
    context.load_cert_chain(certs.client.cert, certs.client.key)
    return http.client.HTTPSConnection("localhost", port, context=context, timeout=10)


def timed(port: int, certs: Certs | None, body: bytes, requests: int) -> list[float]:
    """Seconds per request, from sending it to having the whole reply, after a first one untimed (the
    handshake)."""
    conn = connect(port, certs)
    seconds = []
    try:
        for i in range(requests + 1):
            began = time.perf_counter()
            conn.request("POST", "/filter", body, {"Content-Type": "application/json"})
            reply = conn.getresponse()
            if reply.status != 200 or reply.read() != b'{"Error": ""}':
                raise SystemExit(f"unexpected reply {reply.status}")
            if i:
                seconds.append(time.perf_counter() - began)
    finally:
        conn.close()
    return seconds


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per round and case")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", metavar="PATH", help="another version of gpushare/tlshttp.py to measure too")
    parser.add_argument("--serve", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--tls", nargs=3, default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.tls)
        return 0
    versions = [THIS, *([args.against] if args.against else [])]
    samples: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="httpbench") as directory:
        certs = make_certs(Path(directory))
        for _ in range(args.rounds):
            for version in versions:
                for transport, with_certs in (("plain", None), ("TLS", certs)):
                    with serving(version, with_certs) as port:
                        for size, body in BODIES.items():
                            key = (version, transport, size)
                            samples.setdefault(key, []).extend(timed(port, with_certs, body, args.requests))
    names = {THIS: "this", args.against: "against"}
    print(f"{'µs per request':>16}" + "".join(f"{f'{names[v]} p50':>14}{f'{names[v]} p99':>14}" for v in versions))
    for transport in ("plain", "TLS"):
        for size in BODIES:
            row = []
            for version in versions:
                got = samples[(version, transport, size)]
                row += [statistics.median(got) * 1e6, percentile(got, 0.99) * 1e6]
            print(f"{f'{transport}, {size}':>16}" + "".join(f"{value:14.0f}" for value in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
