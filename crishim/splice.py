"""One kubelet connection spliced onto one runtime connection, frame by frame.

The shim does not terminate gRPC. Kubelet's HTTP/2 connection is carried through to the runtime
frame by frame, so every method, known or not, unary or streaming, with its metadata, deadline,
status, details and trailers, reaches the other side exactly as it was sent, and a call costs two
socket hops, not a second gRPC stack.

The shim reads only what it must: frame headers, kubelet's header blocks (to learn each new call's
method), and the runtime's SETTINGS and window updates (for flow control, see :mod:`gpushare.crishim.flow`).
A call to an intercepted method (CreateContainer; StartContainer, StopPodSandbox and RemovePodSandbox
where limits are set) has its header block forwarded at once (the runtime's HPACK decoder must see every block) while
its DATA is held until the request is whole.
``decide`` then says, on a worker thread, what goes on: the request as it was, a corrected copy, or
a refusal, which resets the runtime's stream and answers kubelet with a gRPC status the shim
encodes itself. The shim writes its own frames only between whole header blocks.

A connection can be drained (:meth:`Splice.drain`), as a shim does that hands its socket to a newer one:
a GOAWAY tells kubelet to open its next calls on a new connection, which reaches the newer shim, while
the calls already under way finish here; a call kubelet opened before it read the GOAWAY is refused
as unprocessed (REFUSED_STREAM, RFC 9113 section 8.7), which gRPC clients send again on their own
(gRPC-Go's ``http2Client.handleRSTStream`` marks such a stream unprocessed for its transparent retry),
and the connection closes once no call is left on it.

What the shim can't follow (a malformed frame or header block) ends the connection: forwarding
blindly could let a CreateContainer through unchecked. Kubelet reconnects, as it would to a runtime
that went away.

Everything but ``decide`` runs on the reactor's one thread, so the state here needs no locks.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field

import grpc
from gpushare.crishim.flow import Windows
from gpushare.crishim.frames import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ERROR_CANCEL,
    ERROR_REFUSED_STREAM,
    FRAME_HEADER,
    HEADERS,
    MIN_MAX_FRAME_SIZE,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    FrameError,
    GrpcFramingError,
    frame,
    frame_at,
    goaway,
    grpc_message,
    header_block,
    headers_frame,
    increment_of,
    rst_stream,
    settings_pairs,
    single_grpc_message,
    unpadded,
    window_update,
)
from gpushare.crishim.headers import HeaderBlockError, PathDecoder, trailers_only_block
from gpushare.crishim.metrics import call_timer
from gpushare.crishim.reactor import Endpoint, Reactor
from prometheus_client import Histogram

log = logging.getLogger(__name__)

#: a held request larger than this is refused (the runtime's own limit is 16 MiB too)
MAX_HELD_BYTES = 16 << 20


def cri_paths(method: str) -> frozenset[bytes]:
    """The HTTP/2 paths of a RuntimeService method; v1alpha2 messages share v1's field numbers."""
    return frozenset(f"/runtime.{version}.RuntimeService/{method}".encode() for version in ("v1", "v1alpha2"))


#: the CRI methods whose requests the shim always decides on
INTERCEPTED = cri_paths("CreateContainer")


@dataclass(frozen=True, slots=True)
class Forward:
    """Send this request message (serialized protobuf) on to the runtime."""

    message: bytes


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer kubelet with this status; the runtime never sees the request."""

    code: grpc.StatusCode
    message: str


Verdict = Forward | Refuse
#: (the call's path, the held request's message) -> what to do with it; runs on a worker thread and may block
Decide = Callable[[bytes, bytes], Verdict]


@dataclass(slots=True)
class _Held:
    """A call whose request the shim holds back."""

    path: bytes = b""
    body: bytearray = field(default_factory=bytearray)
    complete: bool = False
    too_large: bool = False
    cancelled: bool = False  # kubelet reset the stream
    answered: bool = False  # the runtime (or the shim) ended it towards kubelet


class Splice:
    def __init__(
        self,
        reactor: Reactor,
        kubelet: socket.socket,
        runtime: socket.socket,
        decide: Decide,
        pools: Mapping[bytes, Executor],
        on_close: Callable[[Splice], None],
    ) -> None:
        """``pools``: the paths of the calls the shim holds, each with the executor that settles it (a
        slow kind of call, such as a sandbox's stop, then can't hold up CreateContainer's checks)."""
        self._reactor = reactor
        self._decide = decide
        self._pools = pools
        self._on_close = on_close
        self._windows = Windows()
        self._paths = PathDecoder()
        self._held: dict[int, _Held] = {}
        self._sending: deque[tuple[int, bytes, int]] = deque()  # held DATA waiting for window
        self._started: dict[int, tuple[Histogram, float]] = {}
        self._last_stream = 0
        self._preface_seen = False
        self._kubelet_buf = b""
        self._runtime_buf = b""
        self._gated = False  # kubelet's next DATA frame waits for the runtime's window
        #: the last stream the GOAWAY let through, once draining; the calls kubelet opens above it are refused
        self._goaway_at: int | None = None
        self._refused: set[int] = set()
        self.closed = False
        self._kubelet = Endpoint(reactor, kubelet, self._on_kubelet_data, self._hung_up, self._kubelet_drained)
        self._runtime = Endpoint(reactor, runtime, self._on_runtime_data, self._hung_up, self._runtime_drained)

    def close(self) -> None:
        """End both connections now."""
        self._end(Endpoint.close)

    def drain(self) -> None:
        """On the reactor thread: take no new call, let those under way finish, then close."""
        if self.closed or self._goaway_at is not None:
            return
        self._goaway_at = self._last_stream
        self._kubelet.write(goaway(self._last_stream))
        self._close_if_drained()

    def _close_if_drained(self) -> None:
        """Called once the frames at hand are written, never from inside the frame loops."""
        if self._goaway_at is not None and not self._started and not self._held:
            self._end(Endpoint.finish)

    def _hung_up(self) -> None:
        """One side went away: the other still gets what was already relayed to it (a runtime's GOAWAY,
        say), then is closed too."""
        self._end(Endpoint.finish)

    def _end(self, how: Callable[[Endpoint], None]) -> None:
        if self.closed:
            return
        self.closed = True
        how(self._kubelet)
        how(self._runtime)
        self._on_close(self)

    # --- kubelet -> runtime -------------------------------------------------------------------------------

    def _on_kubelet_data(self, data: bytes) -> None:
        buf = self._kubelet_buf + data if self._kubelet_buf else data
        if not self._preface_seen:
            if len(buf) < len(PREFACE):
                self._kubelet_buf = buf
                return
            if not buf.startswith(PREFACE):
                self._fail("the client did not open with the HTTP/2 preface")
                return
            self._preface_seen = True
            self._runtime.write(PREFACE)
            buf = buf[len(PREFACE) :]
        self._kubelet_buf = buf
        self._pump_kubelet()

    def _pump_kubelet(self) -> None:
        try:
            self._kubelet_buf = self._kubelet_frames(self._kubelet_buf)
        except (FrameError, HeaderBlockError) as exc:
            self._fail(str(exc))
            return
        if self._gated or self._runtime.congested:
            self._kubelet.pause_reading()
        else:
            self._kubelet.resume_reading()
        self._close_if_drained()

    def _kubelet_frames(self, buf: bytes) -> bytes:
        """Forward every complete frame of ``buf``, minus held DATA; returns what is left for later."""
        out: list[bytes] = []
        grants: list[bytes] = []
        settle: list[int] = []  # held calls now whole, settled once their HEADERS are on the wire
        run = pos = 0
        self._gated = False
        while (found := frame_at(buf, pos)) is not None:
            end, kind, flags, stream = found
            if kind == DATA:
                held = self._held.get(stream)
                if stream in self._refused:  # nobody takes it: kubelet gets its connection window back
                    out.append(buf[run:pos])
                    run = end
                    if end - pos > FRAME_HEADER:
                        grants.append(window_update(0, end - pos - FRAME_HEADER))
                elif held is not None:
                    out.append(buf[run:pos])
                    run = end
                    if self._hold(held, stream, flags, buf[pos + FRAME_HEADER : end], grants):
                        settle.append(stream)
                elif not self._windows.try_consume(end - pos - FRAME_HEADER):
                    self._gated = True  # until the runtime's next window update (see gpushare.crishim.flow)
                    break
            elif kind == HEADERS:
                block = header_block(buf, pos)
                if block is None:
                    break  # its CONTINUATION frames are still on the way
                fragment, end = block
                if self._refuses(stream, fragment):  # the runtime's HPACK decoder still sees the block
                    out.extend((buf[run:end], rst_stream(stream, ERROR_CANCEL)))
                    run = end
                    grants.append(rst_stream(stream, ERROR_REFUSED_STREAM))
                elif self._on_request_headers(stream, fragment) and flags & END_STREAM:
                    self._held[stream].complete = True  # a request without a message
                    settle.append(stream)
            elif kind == CONTINUATION:
                raise FrameError("CONTINUATION without HEADERS")
            elif kind == RST_STREAM:
                self._on_kubelet_reset(stream)
            pos = end
        out.append(buf[run:pos])
        self._runtime.write(b"".join(out))
        if grants:
            self._kubelet.write(b"".join(grants))
        for stream in settle:
            held = self._held[stream]
            self._pools[held.path].submit(self._settle, stream, held)
        return buf[pos:]

    def _refuses(self, stream: int, fragment: bytes) -> bool:
        """True for a header block of a call opened above the GOAWAY's last stream."""
        if self._goaway_at is None or stream <= self._goaway_at:
            return False
        self._paths.path(fragment)  # keeps the table in step
        self._refused.add(stream)
        return True

    def _on_request_headers(self, stream: int, fragment: bytes) -> bool:
        """Follow a header block from kubelet; True if it opened a call the shim holds."""
        path = self._paths.path(fragment)  # every block, so that the table stays in step
        if stream <= self._last_stream:
            return False  # trailers of a call already open
        self._last_stream = stream
        self._started[stream] = (call_timer(path), time.perf_counter())
        if path not in self._pools:
            return False
        self._windows.track(stream)
        self._held[stream] = _Held(path)
        return True

    def _hold(self, held: _Held, stream: int, flags: int, payload: bytes, grants: list[bytes]) -> bool:
        """Keep a held call's DATA and pay kubelet back for it, as the receiver would; True once the
        request is whole."""
        if payload:
            grants.append(window_update(0, len(payload)))
            if not flags & END_STREAM:
                grants.append(window_update(stream, len(payload)))
        if held.complete:
            return False  # DATA after END_STREAM: a broken client; the runtime never sees it
        data = unpadded(flags, payload)
        if len(held.body) + len(data) > MAX_HELD_BYTES:
            held.too_large = True
        elif not held.too_large:
            held.body += data
        held.complete = bool(flags & END_STREAM)
        return held.complete

    def _on_kubelet_reset(self, stream: int) -> None:
        self._started.pop(stream, None)
        held = self._held.get(stream)
        if held is not None:
            held.cancelled = True
        self._drop_queued(stream)

    def _runtime_drained(self) -> None:
        """The runtime caught up with what we wrote it: kubelet may be read again."""
        if not self._gated:
            self._kubelet.resume_reading()

    # --- runtime -> kubelet -------------------------------------------------------------------------------

    def _on_runtime_data(self, data: bytes) -> None:
        buf = self._runtime_buf + data if self._runtime_buf else data
        try:
            self._runtime_buf = self._runtime_frames(buf)
        except FrameError as exc:
            self._fail(f"runtime: {exc}")
            return
        if self._kubelet.congested:
            self._runtime.pause_reading()
        if self._sending:
            self._send_held()
        if self._gated:
            self._pump_kubelet()
        self._close_if_drained()

    def _runtime_frames(self, buf: bytes) -> bytes:
        out: list[bytes] = []
        run = pos = 0
        while (found := frame_at(buf, pos)) is not None:
            end, kind, flags, stream = found
            if kind == HEADERS and not flags & END_HEADERS:
                block = header_block(buf, pos)  # the shim may write between frames, never inside a block
                if block is None:
                    break
                end = block[1]
            if kind == WINDOW_UPDATE:
                increment = increment_of(buf[pos + FRAME_HEADER : end])
                passed = self._windows.on_update(stream, increment)
                if passed != increment:
                    out.append(buf[run:pos])
                    run = end
                    if passed:
                        out.append(window_update(stream, passed))
            elif kind == SETTINGS and not flags & ACK:
                self._windows.on_settings(settings_pairs(buf[pos + FRAME_HEADER : end]))
            elif kind == RST_STREAM or (flags & END_STREAM and kind in (HEADERS, DATA)):
                self._ended(stream)
            pos = end
        out.append(buf[run:pos])
        self._kubelet.write(b"".join(out))
        return buf[pos:]

    def _ended(self, stream: int) -> None:
        held = self._held.get(stream)
        if held is not None:
            held.answered = True
        self._drop_queued(stream)
        started = self._started.pop(stream, None)
        if started is not None:
            timer, began = started
            timer.observe(time.perf_counter() - began)

    def _kubelet_drained(self) -> None:
        self._runtime.resume_reading()

    # --- settling a held call -----------------------------------------------------------------------------

    def _settle(self, stream: int, held: _Held) -> None:
        """On a worker thread: decide, then hand the verdict to the reactor."""
        verdict = self._verdict(held)
        self._reactor.call_soon(lambda: self._apply(stream, held, verdict))

    def _verdict(self, held: _Held) -> Verdict:
        method = held.path.rsplit(b"/", 1)[-1].decode(errors="replace")
        if held.too_large:
            return Refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method} request over {MAX_HELD_BYTES} bytes")
        try:
            message = single_grpc_message(bytes(held.body))
        except GrpcFramingError as exc:
            return Refuse(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: {exc}")
        try:
            return self._decide(held.path, message)
        except Exception:  # a bug must not let a held call through unchecked
            log.exception("%s check failed; refusing the request", method)
            return Refuse(grpc.StatusCode.INTERNAL, f"the shim's {method} check failed; see the CRI shim's log")

    def _apply(self, stream: int, held: _Held, verdict: Verdict) -> None:
        self._held.pop(stream, None)
        if self.closed or held.cancelled or held.answered:  # nobody waits for this call any more
            self._windows.forget(stream)
            return
        if isinstance(verdict, Refuse):
            self._windows.forget(stream)
            self._runtime.write(rst_stream(stream, ERROR_CANCEL))
            block = trailers_only_block(verdict.code.value[0], verdict.message)
            self._kubelet.write(headers_frame(stream, block, end_stream=True))
            self._ended(stream)
            self._close_if_drained()
            return
        payload = grpc_message(verdict.message)
        for at in range(0, len(payload), MIN_MAX_FRAME_SIZE):
            last = at + MIN_MAX_FRAME_SIZE >= len(payload)
            self._sending.append((stream, payload[at : at + MIN_MAX_FRAME_SIZE], END_STREAM if last else 0))
        self._send_held()

    def _send_held(self) -> None:
        """Send held DATA, in order, as far as the runtime's windows allow."""
        while self._sending:
            stream, chunk, flags = self._sending[0]
            if not self._windows.try_take(stream, len(chunk)):
                return  # again after the runtime's next window update
            self._sending.popleft()
            self._runtime.write(frame(DATA, flags, stream, chunk))
            if flags & END_STREAM:
                self._windows.forget(stream)

    def _drop_queued(self, stream: int) -> None:
        """``stream`` ended while its held DATA was still waiting for window, which will never come now:
        the rest goes nowhere, and must not hold up the calls queued behind it."""
        if self._sending and any(queued == stream for queued, _, _ in self._sending):  # every call ends here
            self._sending = deque(item for item in self._sending if item[0] != stream)
            self._windows.forget(stream)
            self._send_held()

    def _fail(self, reason: str) -> None:
        log.warning("closing a CRI connection: can't follow its HTTP/2 stream (%s)", reason)
        self.close()
