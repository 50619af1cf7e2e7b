"""A small HTTP/1.1 server for the JSON endpoints other components call (the extender's verbs, the
admission webhook): TLS with an optional required client certificate, and bounded memory and threads.

``http.server`` spends one thread per connection for as long as the connection lives, reads whatever
Content-Length announces, and waits forever for a body that never comes. Here instead:

- connections waiting for their next request (or for their first bytes) sit in one selector thread;
- a fixed pool of workers runs the TLS handshakes and the requests, each read against a deadline;
- a body over the limit is refused with 413 before it is read, and at most ``max_connections``
  connections are open at once (more are closed at once).

(cheroot, the obvious library, performs TLS handshakes on its accept thread, so one silent client
stalls every other connection for its whole timeout.)
"""

from __future__ import annotations

import contextlib
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
from http import HTTPStatus

log = logging.getLogger(__name__)

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


@dataclass(frozen=True, slots=True)
class Limits:
    max_body: int = 4 << 20
    max_header: int = 64 << 10
    #: seconds a request (or a TLS handshake) may take once its first bytes arrived
    read_timeout: float = 10.0
    #: seconds a connection may wait for its next request
    idle_timeout: float = 60.0
    workers: int = 8
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
    """A certificate, key or CA file can't be loaded; the message names the file."""


class ServerTLS:
    """A server's TLS settings, loaded again when its files change.

    Kubernetes updates a mounted Secret by swapping a symlink, so the files change all at once; each new
    connection stats the files' resolved paths (cheap) and, when any changed, loads them into a new
    context, which replaces the old one only if it loads. A pair that doesn't load (half written, or a
    key that doesn't match its certificate) is logged naming the file and the old context keeps serving;
    it is tried again when the files change again. TLSFilesError when they can't be loaded at start.
    """

    def __init__(self, cert: str, key: str, client_ca: str | None = None) -> None:
        self._files = (cert, key, client_ca)
        self._lock = threading.Lock()
        self._seen = self._signature()
        self._context = self._load()

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

    def _load(self) -> ssl.SSLContext:
        """TLS 1.2+ with the certificate and key; with a client CA, only clients holding a certificate it
        signed get past the handshake. TLSFilesError naming the file when one can't be loaded."""
        cert, key, client_ca = self._files
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise TLSFilesError(f"TLS certificate {cert} with key {key}: {exc}") from None
        if client_ca:
            context.verify_mode = ssl.CERT_REQUIRED
            try:
                context.load_verify_locations(client_ca)
            except (OSError, ssl.SSLError) as exc:
                raise TLSFilesError(f"TLS client CA {client_ca}: {exc}") from None
        return context

    def context(self) -> ssl.SSLContext:
        """The context for a new connection: the files' as they are now, else the last that loaded."""
        signature = self._signature()
        with self._lock:
            if signature == self._seen:
                return self._context
            self._seen = signature
            try:
                self._context = self._load()
            except TLSFilesError as exc:
                log.error("%s; still serving the certificate loaded before", exc)
            else:
                log.info("TLS files changed; serving certificate %s from now on", os.path.realpath(self._files[0]))
            return self._context


class _Conn:
    __slots__ = ("buf", "fresh", "peer", "since", "sock")

    def __init__(self, sock: socket.socket, peer: object) -> None:
        self.sock = sock
        self.peer = peer
        self.buf = bytearray()
        #: no request served yet (and, with TLS, no handshake done)
        self.fresh = True
        self.since = time.monotonic()


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
    ) -> None:
        self._handler = handler
        self._tls = tls
        self._limits = limits
        self._name = name
        self._listener = socket.create_server((host, port), backlog=1024)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._pool = ThreadPoolExecutor(limits.workers, thread_name_prefix=f"{name}-worker")
        self._lock = threading.Lock()
        self._open: set[_Conn] = set()
        self._returning: deque[_Conn] = deque()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-loop", daemon=True)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            conns = list(self._open)
        for conn in conns:
            self._close(conn)
        self._listener.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    # --- the selector thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        while not self._stopping.is_set():
            for key, _ in self._selector.select(timeout=0.5):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    self._take_returning()
                else:
                    self._selector.unregister(key.fileobj)
                    self._pool.submit(self._serve, key.data)
            self._expire()

    def _accept(self) -> None:
        try:
            sock, peer = self._listener.accept()
        except OSError:
            return
        with self._lock:
            full = len(self._open) >= self._limits.max_connections
        if full:
            log.warning("%s: %d connections open; refusing one from %s", self._name, len(self._open), peer)
            sock.close()
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            sock = self._tls.context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        conn = _Conn(sock, peer)
        with self._lock:
            self._open.add(conn)
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _take_returning(self) -> None:
        while True:
            try:
                if not self._wake_r.recv(4096):
                    break
            except BlockingIOError:
                break
        while True:
            with self._lock:
                if not self._returning:
                    return
                conn = self._returning.popleft()
            conn.since = time.monotonic()
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in list(self._selector.get_map().values()):
            conn = key.data
            if conn is None:
                continue
            limit = self._limits.read_timeout if conn.fresh else self._limits.idle_timeout
            if now - conn.since > limit:
                self._selector.unregister(conn.sock)
                self._close(conn)

    # --- workers ----------------------------------------------------------------------------------------

    def _serve(self, conn: _Conn) -> None:
        keep = False
        try:
            conn.sock.settimeout(self._limits.read_timeout)
            if conn.fresh and self._tls is not None:
                conn.sock.do_handshake()  # type: ignore[attr-defined]
            request = self._read(conn, time.monotonic() + self._limits.read_timeout)
            if request is None:
                return
            conn.fresh = False
            reply = self._answer(request)
            keep = request.headers.get("connection", "").lower() != "close"
            keep = self._send(conn, reply, keep) and keep
        except HttpError as exc:
            keep = False
            log.info("%s: %s from %s: %s", self._name, exc.code, conn.peer, exc)
            self._send(conn, Reply(exc.code, f"{exc}\n".encode(), "text/plain"), False)
        except (OSError, ValueError) as exc:  # timeouts, resets, TLS failures (bad or missing client cert)
            keep = False
            log.debug("%s: connection from %s dropped: %s", self._name, conn.peer, exc)
        except Exception:
            keep = False
            log.exception("%s: connection from %s failed", self._name, conn.peer)
        finally:
            if keep:
                self._park(conn)
            else:
                self._close(conn)

    def _answer(self, request: Request) -> Reply:
        try:
            return self._handler(request)
        except Exception:
            log.exception("%s: %s %s failed", self._name, request.method, request.path)
            return Reply(500, b'{"Error": "internal error; see the server log"}')

    def _recv(self, conn: _Conn, deadline: float) -> bytes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request did not arrive in time")
        conn.sock.settimeout(remaining)
        data = conn.sock.recv(65536)
        conn.buf += data
        return data

    def _read(self, conn: _Conn, deadline: float) -> Request | None:
        limits = self._limits
        while (end := conn.buf.find(b"\r\n\r\n")) < 0:
            if len(conn.buf) > limits.max_header:
                raise HttpError(431, "request header too large")
            if not self._recv(conn, deadline):
                if conn.buf:
                    raise ConnectionResetError("the client closed mid-request")
                return None
        lines = bytes(conn.buf[:end]).decode("latin-1").split("\r\n")
        del conn.buf[: end + 4]
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
        if headers.get("expect", "").lower() == "100-continue" and len(conn.buf) < length:
            conn.sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        while len(conn.buf) < length:
            if not self._recv(conn, deadline):
                raise ConnectionResetError("the client closed mid-body")
        body = bytes(conn.buf[:length])
        del conn.buf[:length]
        return Request(method, path.split("?")[0], headers, body)

    def _send(self, conn: _Conn, reply: Reply, keep: bool) -> bool:
        """One write (so Nagle never delays the body); False when the client is gone."""
        try:
            reason = HTTPStatus(reply.code).phrase
        except ValueError:
            reason = ""
        close = "" if keep else "Connection: close\r\n"
        head = (
            f"HTTP/1.1 {reply.code} {reason}\r\nContent-Type: {reply.content_type}\r\n"
            f"Content-Length: {len(reply.body)}\r\n{close}\r\n"
        )
        try:
            conn.sock.settimeout(self._limits.read_timeout)
            conn.sock.sendall(head.encode("latin-1") + reply.body)
        except OSError as exc:
            log.debug("%s: reply to %s not delivered: %s", self._name, conn.peer, exc)
            return False
        return True

    def _park(self, conn: _Conn) -> None:
        """Back to the selector until the next request; straight back to a worker when one has arrived."""
        pending = conn.buf or (isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending())
        if self._stopping.is_set():
            self._close(conn)
        elif pending:
            try:
                self._pool.submit(self._serve, conn)
            except RuntimeError:  # stopped meanwhile
                self._close(conn)
        else:
            with self._lock:
                self._returning.append(conn)
            try:
                self._wake_w.send(b"x")
            except BlockingIOError:
                pass  # the loop has wake-ups queued already
            except OSError:
                self._close(conn)

    def _close(self, conn: _Conn) -> None:
        with self._lock:
            self._open.discard(conn)
        with contextlib.suppress(OSError):
            conn.sock.close()
