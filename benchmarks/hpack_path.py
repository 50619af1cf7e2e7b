"""What finding each call's method costs the CRI shim: its table-following ``:path`` reader against the
``hpack`` library's full decoder, on the header blocks a gRPC client sends.

    python benchmarks/hpack_path.py [--blocks 20000]

Two kinds of block, both encoded by ``hpack``'s encoder: the first call on a connection (every header a
literal, added to the table) and a warm call (every header already in the table, so all indexed, as
grpc-core sends them once warm).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from hpack import Decoder, Encoder

from crishim.headers import PathDecoder

HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/runtime.v1.RuntimeService/ListContainers"),
    (":authority", "localhost"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
    ("grpc-accept-encoding", "identity, deflate, gzip"),
    ("user-agent", "grpc-python/1.85.1 grpc-c/58.0.0 (linux; chttp2)"),
]


def per_block_us(decode: Callable[[bytes], object], block: bytes, count: int) -> float:
    """Median over 5 runs of the microseconds one ``decode(block)`` takes."""
    runs = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(count):
            decode(block)
        runs.append((time.perf_counter() - began) / count * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=20000)
    args = parser.parse_args()
    encoder = Encoder()
    first = encoder.encode(HEADERS)
    warm = encoder.encode(HEADERS)
    reference, follower = Decoder(), PathDecoder()
    reference.decode(first)
    follower.path(first)
    assert follower.path(warm) == reference.decode(warm, raw=True)[2][1]  # both at the same table state
    print(f"{'block':<28}{'hpack.Decoder':>14}{'PathDecoder':>13}{'ratio':>8}")
    for name, block in (("first call (literals)", first), ("warm call (all indexed)", warm)):
        # replaying the same block keeps both tables in the same state: each adds what the other adds
        full = per_block_us(lambda b: reference.decode(b, raw=True), block, args.blocks)
        ours = per_block_us(follower.path, block, args.blocks)
        print(f"{name:<28}{full:>11.1f} us{ours:>10.1f} us{full / ours:>7.1f}x")


if __name__ == "__main__":
    main()
