"""A small HTTP/1.1 server for the endpoints other components call (the extender's verbs, the admission
webhook, every component's /healthz, /readyz and /metrics): TLS with an optional required client
certificate, and bounded memory, threads and time.

``http.server`` spends one thread per connection for as long as the connection lives, reads whatever
Content-Length announces, and waits forever for a body that never comes. Here instead one selector
thread does all the waiting, without blocking on any one peer:

- it runs each TLS handshake a step at a time as bytes arrive, reads each request until it is whole,
  and writes each reply as the peer takes it, every step against a deadline;
- only a whole request goes to the fixed pool of workers, which run the handler and nothing else, so a
  peer that sends slowly (or never finishes its handshake) holds a socket, never a worker;
- a body over the limit is refused with 413 before it is read;
- at most ``max_connections`` connections are open: a new one closes the oldest that is waiting on its
  peer, peers that have proved nothing first (still in the handshake, or not yet past their first
  request, and without a verified client certificate); a kube-scheduler connection with its
  certificate, idle between requests, goes last.

What peers can provoke (refused connections, malformed requests) is logged at most once per
``LOG_EVERY`` seconds, with a count.

(cheroot, the obvious library, performs TLS handshakes on its accept thread, so one silent client
stalls every other connection for its whole timeout.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from http import HTTPStatus
from pathlib import Path

from cryptography import x509

log = logging.getLogger(__name__)

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
#: seconds between two log lines about what peers provoke
LOG_EVERY = 10.0


@dataclass(frozen=True, slots=True)
class Limits:
    max_body: int = 4 << 20
    max_header: int = 64 << 10
    #: seconds a TLS handshake, a request once its first bytes arrived (a new connection's first request
    #: from the end of the handshake), or the delivery of a reply may take
    read_timeout: float = 10.0
    #: seconds a connection may wait for its next request
    idle_timeout: float = 60.0
    workers: int = 8
    #: workers for the requests the server's ``slow`` predicate picks (none without one)
    slow_workers: int = 8
    max_connections: int = 256


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    #: names in lower case
    headers: Mapping[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class Reply:
    code: int
    body: bytes
    content_type: str = "application/json"


Handler = Callable[[Request], Reply]


class HttpError(Exception):
    """The request can't be served as sent; answered with ``code`` and the connection closed."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class TLSFilesError(ValueError):
    """A certificate, key or CA file can't be loaded, or the certificate isn't valid now; the message
    names the file. ``valid_from`` is set when the certificate is valid only from a later time."""

    def __init__(self, message: str, valid_from: datetime | None = None) -> None:
        super().__init__(message)
        self.valid_from = valid_from


def _validity(cert: str) -> tuple[datetime, datetime]:
    """When the (first) certificate in the file is valid: from, to."""
    try:
        leaf = x509.load_pem_x509_certificate(Path(cert).read_bytes())
    except (OSError, ValueError) as exc:
        raise TLSFilesError(f"TLS certificate {cert}: {exc}") from None
    return leaf.not_valid_before_utc, leaf.not_valid_after_utc


def _dates(valid_from: datetime, valid_to: datetime) -> str:
    return f"valid from {valid_from:%Y-%m-%d %H:%M:%S} to {valid_to:%Y-%m-%d %H:%M:%S} UTC"


class ServerTLS:
    """A server's TLS settings, loaded again when its files change.

    Kubernetes updates a mounted Secret by swapping a symlink, so the files change all at once; each new
    connection stats the files' resolved paths (cheap) and, when any changed, loads them into a new
    context, which replaces the old one only if it loads. A pair that doesn't load (half written, a key
    that doesn't match its certificate, or a certificate expired or not yet valid) is logged naming the
    file and the old context keeps serving; it is tried again when the files change again, or, when it
    was not valid yet, once it is. TLSFilesError when they can't be loaded at start. The certificate
    served expiring is logged once.
    """

    def __init__(self, cert: str, key: str, client_ca: str | None = None) -> None:
        self._files = (cert, key, client_ca)
        self._lock = threading.Lock()
        self._seen = self._signature()
        #: when the files as they are become valid (they were refused as not valid yet)
        self._retry_at: datetime | None = None
        self._context, self._valid_to = self._load()
        self._expiry_told = False

    def _signature(self) -> tuple[tuple[str, int, int, int] | None, ...]:
        signature = []
        for path in self._files:
            if path is None:
                signature.append(None)
                continue
            real = os.path.realpath(path)
            try:
                st = os.stat(real)
            except OSError:
                signature.append((real, -1, -1, -1))
                continue
            signature.append((real, st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(signature)

    def _load(self) -> tuple[ssl.SSLContext, datetime]:
        """TLS 1.2+ with the certificate and key, and when the certificate expires; with a client CA, only
        clients holding a certificate it signed get past the handshake. TLSFilesError naming the file
        when one can't be loaded or the certificate isn't valid now."""
        cert, key, client_ca = self._files
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise TLSFilesError(f"TLS certificate {cert} with key {key}: {exc}") from None
        valid_from, valid_to = _validity(cert)
        now = datetime.now(UTC)
        if now < valid_from:
            raise TLSFilesError(f"TLS certificate {cert} is not valid yet: {_dates(valid_from, valid_to)}", valid_from)
        if now > valid_to:
            raise TLSFilesError(f"TLS certificate {cert} has expired: {_dates(valid_from, valid_to)}")
        if client_ca:
            context.verify_mode = ssl.CERT_REQUIRED
            try:
                context.load_verify_locations(client_ca)
            except (OSError, ssl.SSLError) as exc:
                raise TLSFilesError(f"TLS client CA {client_ca}: {exc}") from None
        return context, valid_to

    def context(self) -> ssl.SSLContext:
        """The context for a new connection: the files' as they are now, else the last that loaded."""
        signature = self._signature()
        now = datetime.now(UTC)
        with self._lock:
            if signature == self._seen and (self._retry_at is None or now < self._retry_at):
                if now > self._valid_to and not self._expiry_told:
                    self._expiry_told = True
                    log.error(
                        "TLS certificate %s expired at %s UTC; renew it",
                        self._files[0],
                        f"{self._valid_to:%Y-%m-%d %H:%M:%S}",
                    )
                return self._context
            self._seen, self._retry_at = signature, None
            try:
                self._context, self._valid_to = self._load()
            except TLSFilesError as exc:
                self._retry_at = exc.valid_from
                log.error("%s; still serving the certificate loaded before", exc)
            else:
                self._expiry_told = False
                log.info("TLS files changed; serving certificate %s from now on", os.path.realpath(self._files[0]))
            return self._context


class _Throttled:
    """A log line for something peers can provoke at will: the first at once, then at most one per
    ``every`` seconds, saying how many were left out. Used from the selector thread only."""

    def __init__(self, level: int, every: float = LOG_EVERY) -> None:
        self._level = level
        self._every = every
        self._last = -every
        self._left_out = 0

    def __call__(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self._every:
            self._left_out += 1
            return
        if self._left_out:
            message += f" ({self._left_out} more like it in the last {now - self._last:.0f} s)"
        log.log(self._level, message, *args)
        self._last, self._left_out = now, 0


_HANDSHAKE, _READ, _BUSY, _WRITE = "handshake", "read", "busy", "write"


class _Conn:
    __slots__ = ("buf", "continued", "deadline", "events", "keep", "out", "peer", "served", "sock", "state", "trusted")

    def __init__(self, sock: socket.socket, peer: object, state: str, deadline: float) -> None:
        self.sock = sock
        self.peer = peer
        self.state = state
        self.deadline = deadline
        #: what the selector watches for (0: not registered, e.g. while a worker has it)
        self.events = 0
        self.buf = bytearray()
        self.out = bytearray()
        self.keep = False
        #: requests answered on it
        self.served = 0
        #: the peer showed a client certificate the server verified
        self.trusted = False
        #: "100 Continue" sent for the request being read
        self.continued = False

    def eviction_rank(self) -> tuple[bool, bool]:
        """Lower goes first: peers that proved nothing, then peers that were answered before."""
        return self.trusted, self.served > 0


@dataclass(frozen=True, slots=True)
class _Head:
    #: without its body
    request: Request
    length: int
    #: where the body starts in the buffer
    start: int


def parse_head(buf: bytes | bytearray, limits: Limits) -> _Head | None:
    """The request line and headers at the start of ``buf``; None while they are incomplete, HttpError
    when they can't be served."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > limits.max_header:
            raise HttpError(431, "request header too large")
        return None
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, "malformed request line")
    method, path, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise HttpError(400, "malformed header line")
        headers[name.strip().lower()] = value.strip()
    if version == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
        headers["connection"] = "close"
    if "transfer-encoding" in headers:
        raise HttpError(411, "send the body with a Content-Length")
    length_text = headers.get("content-length")
    if length_text is None:
        if method in _BODY_METHODS:
            raise HttpError(411, "a Content-Length is required")
        length_text = "0"
    if not length_text.isdigit():
        raise HttpError(400, "malformed Content-Length")
    length = int(length_text)
    if length > limits.max_body:
        raise HttpError(413, f"the body is {length} bytes; at most {limits.max_body} are accepted")
    return _Head(Request(method, path.split("?")[0], headers, b""), length, end + 4)


def encode_reply(reply: Reply, keep: bool) -> bytes:
    """Head and body in one piece (one write, so Nagle never delays the body)."""
    try:
        reason = HTTPStatus(reply.code).phrase
    except ValueError:
        reason = ""
    close = "" if keep else "Connection: close\r\n"
    head = (
        f"HTTP/1.1 {reply.code} {reason}\r\nContent-Type: {reply.content_type}\r\n"
        f"Content-Length: {len(reply.body)}\r\n{close}\r\n"
    )
    return head.encode("latin-1") + reply.body


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=1024)
    sock.setblocking(False)
    return sock


class HttpServer:
    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        *,
        tls: ServerTLS | None = None,
        limits: Limits = DEFAULT_LIMITS,
        name: str = "http",
        slow: Callable[[Request], bool] | None = None,
    ) -> None:
        """Requests for which ``slow`` is true run on workers of their own, so that however many of them
        wait (on other servers, on each other) the others never queue behind them."""
        self._handler = handler
        self._tls = tls
        self._limits = limits
        self._name = name
        self._listener = _listen(host, port)
        self.host: str = self._listener.getsockname()[0]
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._pool = ThreadPoolExecutor(limits.workers, thread_name_prefix=f"{name}-worker")
        self._slow = slow
        self._slow_pool = (
            ThreadPoolExecutor(limits.slow_workers, thread_name_prefix=f"{name}-slow") if slow is not None else None
        )
        self._lock = threading.Lock()
        #: every open connection, oldest accepted first (the selector thread alone adds and removes)
        self._open: dict[_Conn, None] = {}
        #: connections a worker answered, with the reply to write
        self._returning: deque[tuple[_Conn, bytes]] = deque()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-loop", daemon=True)
        self._log_full = _Throttled(logging.WARNING)
        self._log_refused = _Throttled(logging.INFO)
        self._next_expiry = 0.0

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for pool in (self._pool, self._slow_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            conns = list(self._open)
            self._open.clear()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._listener.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    # --- the selector thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        while not self._stopping.is_set():
            for key, _ in self._selector.select(timeout=0.25):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    self._take_returning()
                else:
                    self._step(key.data)
            self._expire()

    def _accept(self) -> None:
        for _ in range(64):  # a burst at a time, then the connections already open get their turn
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            if len(self._open) >= self._limits.max_connections and not self._evict_for(peer):
                self._log_full(
                    "%s: %d connections open, all with a worker; refusing %s", self._name, len(self._open), peer
                )
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + self._limits.read_timeout
            if self._tls is None:
                conn = _Conn(sock, peer, _READ, deadline)
            else:
                wrapped = self._tls.context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                conn = _Conn(wrapped, peer, _HANDSHAKE, deadline)
            with self._lock:
                self._open[conn] = None
            self._want(conn, selectors.EVENT_READ)

    def _evict_for(self, peer: object) -> bool:
        """Make room for a new connection by closing the oldest one waiting on its peer, the least proven
        first (see the module doc). False when every connection is with a worker."""
        waiting = (conn for conn in self._open if conn.state != _BUSY)
        # the oldest accepted comes first, so under a flood of silent peers this stops at the first
        victim = next((conn for conn in waiting if conn.eviction_rank() == (False, False)), None)
        if victim is None:
            candidates = [conn for conn in self._open if conn.state != _BUSY]
            if not candidates:
                return False
            victim = min(candidates, key=_Conn.eviction_rank)
        self._log_full(
            "%s: %d connections open; closing the oldest %s one (from %s) for one from %s",
            self._name,
            len(self._open),
            "unproven" if victim.eviction_rank() == (False, False) else "idle",
            victim.peer,
            peer,
        )
        self._close(victim)
        return True

    def _want(self, conn: _Conn, events: int) -> None:
        if conn.events == events:
            return
        if conn.events:
            self._selector.modify(conn.sock, events, conn)
        else:
            self._selector.register(conn.sock, events, conn)
        conn.events = events

    def _step(self, conn: _Conn, action: Callable[[_Conn], None] | None = None) -> None:
        """Take a connection as far as its peer's bytes allow (handshake, read, hand over, write), or do
        ``action``; whatever goes wrong closes this connection alone."""
        try:
            try:
                (action or self._advance)(conn)
            except HttpError as exc:
                self._log_refused("%s: %s from %s: %s", self._name, exc.code, conn.peer, exc)
                conn.buf.clear()
                self._reply(conn, encode_reply(Reply(exc.code, f"{exc}\n".encode(), "text/plain"), False), False)
        except (OSError, ValueError) as exc:  # resets, TLS failures (bad or missing client cert)
            log.debug("%s: connection from %s dropped: %s", self._name, conn.peer, exc)
            self._close(conn)
        except Exception:
            log.exception("%s: connection from %s failed", self._name, conn.peer)
            self._close(conn)

    def _advance(self, conn: _Conn) -> None:
        if conn.state == _HANDSHAKE:
            self._handshake(conn)
        elif conn.state == _READ:
            self._read(conn)
        elif conn.state == _WRITE:
            self._write(conn)

    def _handshake(self, conn: _Conn) -> None:
        try:
            conn.sock.do_handshake()  # type: ignore[attr-defined]
        except ssl.SSLWantReadError:
            self._want(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._want(conn, selectors.EVENT_WRITE)
            return
        conn.trusted = conn.sock.context.verify_mode == ssl.CERT_REQUIRED  # type: ignore[attr-defined]
        conn.state = _READ
        conn.deadline = time.monotonic() + self._limits.read_timeout
        self._read(conn)

    def _read(self, conn: _Conn) -> None:
        limit = self._limits.max_header + self._limits.max_body
        while len(conn.buf) <= limit:
            try:
                data = conn.sock.recv(65536)
            except (BlockingIOError, ssl.SSLWantReadError):
                break
            except ssl.SSLWantWriteError:
                self._want(conn, selectors.EVENT_WRITE)
                return
            if not data:
                if conn.buf:
                    log.debug("%s: %s closed mid-request", self._name, conn.peer)
                self._close(conn)
                return
            if not conn.buf and conn.served:  # the first bytes of a next request: it has read_timeout
                conn.deadline = time.monotonic() + self._limits.read_timeout
            conn.buf += data
        self._take_request(conn)

    def _take_request(self, conn: _Conn) -> None:
        """Hand a whole request to a worker; otherwise wait for more of it."""
        head = parse_head(conn.buf, self._limits)
        if head is None or len(conn.buf) < head.start + head.length:
            expect = head.request.headers.get("expect", "") if head is not None else ""
            if not conn.continued and expect.lower() == "100-continue":
                conn.continued = True
                with contextlib.suppress(BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                    conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")  # tiny: fits, else the peer sends anyway
            self._want(conn, selectors.EVENT_READ)
            return
        request = dataclasses.replace(head.request, body=bytes(conn.buf[head.start : head.start + head.length]))
        del conn.buf[: head.start + head.length]
        conn.continued = False
        self._selector.unregister(conn.sock)
        conn.events = 0
        conn.state = _BUSY
        try:
            slow = self._slow_pool is not None and self._slow is not None and self._slow(request)
            (self._slow_pool if slow else self._pool).submit(self._work, conn, request)
        except RuntimeError:  # stopped meanwhile
            self._close(conn)

    def _reply(self, conn: _Conn, data: bytes, keep: bool) -> None:
        conn.out[:] = data
        conn.keep = keep
        conn.state = _WRITE
        conn.deadline = time.monotonic() + self._limits.read_timeout
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        while conn.out:
            try:
                sent = conn.sock.send(conn.out)
            except (BlockingIOError, ssl.SSLWantWriteError):
                self._want(conn, selectors.EVENT_WRITE)
                return
            except ssl.SSLWantReadError:
                self._want(conn, selectors.EVENT_READ)
                return
            del conn.out[:sent]
        if not conn.keep:
            self._close(conn)
            return
        conn.served += 1
        conn.state = _READ
        now = time.monotonic()
        conn.deadline = now + (self._limits.read_timeout if conn.buf else self._limits.idle_timeout)
        if conn.buf or (isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending()):
            self._read(conn)  # the next request came along with this one
        else:
            self._want(conn, selectors.EVENT_READ)

    def _take_returning(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass
        while True:
            with self._lock:
                if not self._returning:
                    return
                conn, data = self._returning.popleft()
            if conn in self._open:
                self._step(conn, lambda c, data=data: self._reply(c, data, c.keep))

    def _expire(self) -> None:
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._next_expiry = now + 0.05
        for conn in [c for c in self._open if c.state != _BUSY and now > c.deadline]:
            log.debug("%s: %s from %s timed out", self._name, conn.state, conn.peer)
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.events:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
            conn.events = 0
        with self._lock:
            self._open.pop(conn, None)
        with contextlib.suppress(OSError):
            conn.sock.close()

    # --- workers ----------------------------------------------------------------------------------------

    def _work(self, conn: _Conn, request: Request) -> None:
        """Run the handler, then give the reply to the selector thread to write."""
        try:
            reply = self._handler(request)
        except Exception:
            log.exception("%s: %s %s failed", self._name, request.method, request.path)
            reply = Reply(500, b'{"Error": "internal error; see the server log"}')
        conn.keep = request.headers.get("connection", "").lower() != "close"
        with self._lock:
            self._returning.append((conn, encode_reply(reply, conn.keep)))
        with contextlib.suppress(BlockingIOError, OSError):  # wake-ups already queued, or stopped
            self._wake_w.send(b"x")
