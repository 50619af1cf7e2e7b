"""The HTTP server for the endpoints other components call (the extender's verbs, the admission
webhook, every component's /healthz, /readyz and /metrics): aiohttp's HTTP/1.1 on one asyncio loop
thread per server, TLS with an optional required client certificate, and bounded memory, threads and
time.

aiohttp parses and writes HTTP; what it leaves to its user is kept here:

- the connections are accepted here, so that at most ``max_connections`` are open: a new one closes the
  oldest that is waiting on its peer, peers that have proved nothing first (still in the handshake, or
  not yet past their first request, and without a verified client certificate); a kube-scheduler
  connection with its certificate, idle between requests, goes last;
- each accepted socket gets the TLS context of the certificate files as they are now (``ServerTLS``),
  and asyncio runs its handshake without blocking, against ``read_timeout``;
- a request's head and body must arrive within ``read_timeout`` of its first byte (a new connection's
  first request: of the end of its handshake) and its reply be taken within as long; a connection waits
  ``idle_timeout`` for its next request (aiohttp has neither deadline);
- a body over the limit is refused with 413 before it is read, a body without a Content-Length with 411;
- the handlers are synchronous, CPU-bound Python: each whole request goes to a fixed pool of workers
  (or, when the server's ``slow`` predicate picks it, to a pool of its own), which run the handler and
  nothing else, so a peer that sends slowly (or never finishes its handshake) holds a socket, never a
  worker;
- a JSON body is parsed by :func:`parse_json`, which refuses one nested deeper than ``MAX_JSON_DEPTH``
  before the decoder recurses into it.

What peers can provoke (refused connections, malformed requests) and a handler's failures (a 500, one
line naming the exception and where it was raised) are logged at most once per ``LOG_EVERY`` seconds
for each kind, with a count.

Why aiohttp rather than our own selector loop, which this replaced: one well-kept HTTP implementation
instead of a hand-written parser, for about a quarter of a millisecond more per request. Measured side by
side on one shared 2-core machine: ``benchmarks/extender_latency.py`` (5,000 nodes x 8 cards),
filter+prioritize p50 4.35 and 4.36 ms against 4.21 and 4.25 ms, p99 14.5 and 14.6 ms against 22.3 and
16.8 ms (noise; the budget is 20 ms); ``benchmarks/http_overhead.py`` (a handler that answers at once),
a median per request of 470-590 µs against 205-400 µs. (cheroot, another candidate, performs TLS
handshakes on its accept thread, so one silent client stalls every other connection for its whole
timeout.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import ssl
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError
from cryptography import x509

from gpushare.contract import jsondepth
from gpushare.contract.errors import quoted
from gpushare.contract.jsondepth import MAX_JSON_DEPTH

log = logging.getLogger(__name__)

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
#: seconds between two log lines about what peers provoke
LOG_EVERY = 10.0
#: what every reply says in its Server header (aiohttp's own names the Python and aiohttp versions)
SERVER_HEADER = {"Server": "gpushare"}
#: seconds to wait before accepting again when accepting fails (as when out of file descriptors)
ACCEPT_PAUSE = 0.1


@dataclass(frozen=True, slots=True)
class Limits:
    max_body: int = 4 << 20
    #: bytes in the request line and in each header
    max_header: int = 8 << 10
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


class BadJSON(ValueError):
    """A request body that isn't JSON or nests deeper than allowed; the message says which."""


def parse_json(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A request's JSON body, as every JSON endpoint reads it: BadJSON (a ValueError, which the endpoints
    answer with 400) when it isn't JSON or nests more than ``max_depth`` deep, refused before
    ``json.loads`` can recurse into it. Its size is bounded before it is read (``Limits.max_body``)."""
    try:
        return jsondepth.loads(body, max_depth)
    except jsondepth.TooDeep as exc:
        raise BadJSON(f"the JSON body {exc}") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise BadJSON(f"the body is not JSON: {exc}") from None


class _Throttled:
    """A log line for something that can recur at will: the first of each ``kind`` at once, then at most
    one per ``every`` seconds, saying how many were left out. The ``kinds`` told longest ago are
    forgotten first. Thread-safe."""

    def __init__(self, level: int, every: float = LOG_EVERY, kinds: int = 64) -> None:
        self._level = level
        self._every = every
        self._kinds = kinds
        self._lock = threading.Lock()
        #: kind -> when it was last told, and how many like it were left out since
        self._told: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()

    def __call__(self, message: str, *args: object, kind: Hashable = None) -> None:
        now = time.monotonic()
        with self._lock:
            last, left_out = self._told.get(kind, (-math.inf, 0))
            if now - last < self._every:
                self._told[kind] = (last, left_out + 1)
                return
            self._told[kind] = (now, 0)
            self._told.move_to_end(kind)
            if len(self._told) > self._kinds:
                self._told.popitem(last=False)
        if left_out:
            message += f" ({left_out} more like it in the last {now - last:.0f} s)"
        log.log(self._level, message, *args)


def _failure(exc: BaseException) -> tuple[str, Hashable]:
    """One line on a handler's exception (its type, message and where it was raised), and its kind: the
    type and the place, so the same bug hit with different values is one kind."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return f"{type(exc).__name__}: {quoted(str(exc))}", type(exc)
    last = frames[-1]
    line = f"{type(exc).__name__}: {quoted(str(exc))} at {last.filename}:{last.lineno} in {last.name}"
    return line, (type(exc), last.filename, last.lineno)


def refusal(method: str, headers: Mapping[str, str], limits: Limits) -> tuple[int, str] | None:
    """Why a request whose head is ``method`` and ``headers`` (names in any case) can't be served, as the
    status and a message, before its body is read; None when it can."""
    if "transfer-encoding" in headers:
        return 411, "send the body with a Content-Length"
    length = headers.get("content-length")
    if length is None:
        return (411, "a Content-Length is required") if method in _BODY_METHODS else None
    # aiohttp answers a Content-Length that isn't a number with 400 itself
    if int(length) > limits.max_body:
        return 413, f"the body is {length} bytes; at most {limits.max_body} are accepted"
    return None


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=1024)
    sock.setblocking(False)
    return sock


_HANDSHAKE, _IDLE, _READING, _BUSY, _WRITING = "handshake", "idle", "reading", "busy", "writing"


class _Conn(asyncio.Protocol):
    """One connection: where it is in its life (for its deadline and its place in the eviction order);
    the HTTP it carries is aiohttp's protocol's, which gets every event."""

    def __init__(self, server: HttpServer, sock: socket.socket, peer: object) -> None:
        self.server = server
        self.sock = sock
        self.peer = peer
        self.state = _HANDSHAKE
        #: the handshake and then the connection's setting up, until ``connection_made``
        self.task: asyncio.Task[Any] | None = None
        self.transport: asyncio.Transport | None = None
        self.http: web.RequestHandler | None = None
        self._timer: asyncio.TimerHandle | None = None
        #: the peer showed a client certificate the server verified
        self.trusted = False
        #: requests answered on it
        self.served = 0
        #: bytes of a next request came while this one was with a worker or its reply on its way
        self.more = False

    def eviction_rank(self) -> tuple[bool, bool]:
        """Lower goes first: peers that proved nothing, then peers that were answered before."""
        return self.trusted, self.served > 0

    # --- deadlines --------------------------------------------------------------------------------------

    def wait(self, state: str, seconds: float | None) -> None:
        """Enter ``state``; closed unless it ends within ``seconds`` (None: no deadline)."""
        self.state = state
        self._disarm()
        if seconds is not None:
            self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        log.debug("%s: %s from %s timed out", self.server.name, self.state, self.peer)
        self.close()

    def reading(self) -> None:
        """A request began (its head is read, or its first bytes came)."""
        if self.state == _IDLE:
            self.wait(_READING, self.server.limits.read_timeout)

    def answered(self) -> None:
        self.served += 1
        if self.more:
            self.more = False
            self.wait(_READING, self.server.limits.read_timeout)
        else:
            self.wait(_IDLE, self.server.limits.idle_timeout)

    def close(self) -> None:
        """Drop the connection at once, whatever it is doing."""
        self.server._forget(self)
        self._disarm()
        if self.transport is not None:
            self.transport.abort()
        elif self.task is not None:
            self.task.cancel()  # in the handshake: ``admitted`` closes the socket
        else:  # not yet set up
            self.sock.close()

    def admitted(self, task: asyncio.Task[Any]) -> None:
        """The handshake ended; when it failed (or the connection was dropped meanwhile), the socket is
        closed here, since asyncio doesn't when the task never ran."""
        if not task.cancelled() and task.exception() is None:
            return
        if not task.cancelled():  # a peer without a valid client certificate, or a handshake timed out
            log.debug("%s: connection from %s dropped: %s", self.server.name, self.peer, task.exception())
        self.server._forget(self)
        self.sock.close()

    # --- asyncio.Protocol, passed on to aiohttp's ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.trusted = bool(transport.get_extra_info("peercert"))
        self.http = self.server._protocol_for(self)
        self.http.connection_made(transport)
        self.wait(_IDLE, self.server.limits.read_timeout)  # the first request comes at once

    def data_received(self, data: bytes) -> None:
        if self.state in (_BUSY, _WRITING):
            self.more = True
        self.reading()
        assert self.http is not None
        self.http.data_received(data)

    def eof_received(self) -> bool | None:
        assert self.http is not None
        return self.http.eof_received()

    def pause_writing(self) -> None:
        assert self.http is not None
        self.http.pause_writing()

    def resume_writing(self) -> None:
        assert self.http is not None
        self.http.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._forget(self)
        self._disarm()
        if self.http is not None:
            self.http.connection_lost(exc)


class _AiohttpLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's log for a server: a request it can't parse (what a peer provokes at will, which aiohttp
    logs as an error with its traceback) is one throttled line instead."""

    def __init__(self, name: str, refused: _Throttled) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self._name = name
        self._refused = refused

    def log(self, level: int, msg: object, *args: object, exc_info: Any = None, **kwargs: Any) -> None:
        if level >= logging.WARNING and isinstance(exc_info, HttpProcessingError):
            peer = args[0] if args else "?"
            self._refused("%s: %s from %s: %s", self._name, exc_info.code, peer, quoted(exc_info.message))
            return
        super().log(level, msg, *args, exc_info=exc_info, **kwargs)


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
        wait (on other servers, on each other) the others never queue behind them. Listens from here on;
        answers from ``start``."""
        self._handler = handler
        self._tls = tls
        self.limits = limits
        self.name = name
        self._slow = slow
        self._pool = ThreadPoolExecutor(limits.workers, thread_name_prefix=f"{name}-worker")
        self._slow_pool = (
            ThreadPoolExecutor(limits.slow_workers, thread_name_prefix=f"{name}-slow") if slow is not None else None
        )
        self._listener = _listen(host, port)
        self.host: str = self._listener.getsockname()[0]
        self.port: int = self._listener.getsockname()[1]
        #: every open connection, oldest accepted first (the loop thread alone adds and removes)
        self._open: dict[_Conn, None] = {}
        #: the connection of each of aiohttp's protocols
        self._conn_of: dict[web.RequestHandler, _Conn] = {}
        self._log_full = _Throttled(logging.WARNING)
        self._log_refused = _Throttled(logging.INFO)
        self._log_failed = _Throttled(logging.ERROR)
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving = threading.Event()
        self._stopping = asyncio.Event()
        self._stopped = False
        self._web: web.Server | None = None

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def start(self) -> None:
        """Returns once the server answers."""
        self._thread.start()
        self._serving.wait()

    def stop(self) -> None:
        """Close every connection, the listener and the workers' pools, and end the loop thread."""
        if self._stopped:
            return
        self._stopped = True
        if self._loop is None:  # never started
            self._release()
            return
        with contextlib.suppress(RuntimeError):  # the loop already ended
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            log.error("%s: the server's loop did not end", self.name)

    def _release(self) -> None:
        for pool in (self._pool, self._slow_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._listener.close()

    # --- the loop thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        except Exception:
            log.exception("%s: the server failed", self.name)
        finally:
            self._serving.set()
            self._release()
            self._loop.close()

    async def _serve(self) -> None:
        limits = self.limits
        self._web = web.Server(
            self._respond,
            # a backstop that never fires before the deadlines kept here
            keepalive_timeout=limits.idle_timeout + limits.read_timeout,
            lingering_time=0,  # a refused body is not read
            max_line_size=limits.max_header,
            max_field_size=limits.max_header,
            access_log=None,
            logger=_AiohttpLog(self.name, self._log_refused),
        )
        accepting = asyncio.create_task(self._accept())
        stopping = asyncio.create_task(self._stopping.wait())
        self._serving.set()
        try:
            await asyncio.wait((accepting, stopping), return_when=asyncio.FIRST_COMPLETED)
            if accepting.done():
                accepting.result()  # raises what ended it
        finally:
            for conn in list(self._open):
                conn.close()
            others = asyncio.all_tasks() - {asyncio.current_task()}
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            await asyncio.sleep(0)  # the transports close their sockets on the loop's next turn

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, peer = await loop.sock_accept(self._listener)
            except OSError as exc:  # as when out of file descriptors: the open connections get their turn
                self._log_full("%s: can't accept a connection: %s", self.name, exc)
                await asyncio.sleep(ACCEPT_PAUSE)
                continue
            if len(self._open) >= self.limits.max_connections and not self._evict_for(peer):
                self._log_full(
                    "%s: %d connections open, all with a worker; refusing %s", self.name, len(self._open), peer
                )
                sock.close()
                continue
            conn = _Conn(self, sock, peer)
            self._open[conn] = None
            context = self._tls.context() if self._tls is not None else None
            conn.task = asyncio.create_task(
                loop.connect_accepted_socket(
                    lambda conn=conn: conn,
                    sock,
                    ssl=context,
                    ssl_handshake_timeout=self.limits.read_timeout if context is not None else None,
                    ssl_shutdown_timeout=self.limits.read_timeout if context is not None else None,
                )
            )
            conn.task.add_done_callback(conn.admitted)

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
            self.name,
            len(self._open),
            "unproven" if victim.eviction_rank() == (False, False) else "idle",
            victim.peer,
            peer,
        )
        victim.close()
        return True

    def _protocol_for(self, conn: _Conn) -> web.RequestHandler:
        """aiohttp's protocol for a connection past its handshake."""
        assert self._web is not None
        http = self._web()
        self._conn_of[http] = conn
        return http

    def _forget(self, conn: _Conn) -> None:
        self._open.pop(conn, None)
        if conn.http is not None:
            self._conn_of.pop(conn.http, None)

    async def _respond(self, request: web.BaseRequest) -> web.StreamResponse:
        """Read the request whole, have a worker answer it, and deliver the reply, each against its
        deadline."""
        conn = self._conn_of.get(request.protocol)
        if conn is None:  # dropped before its turn came
            return web.Response(status=408, headers=SERVER_HEADER)
        conn.reading()
        refused = refusal(request.method, request.headers, self.limits)
        if refused is not None:
            code, message = refused
            self._log_refused("%s: %s from %s: %s", self.name, code, conn.peer, message)
            reply = web.Response(status=code, text=f"{message}\n", headers=SERVER_HEADER)
            reply.force_close()
            return reply
        try:
            if request.version == HttpVersion11 and request.headers.get("Expect", "").lower() == "100-continue":
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                request.writer.output_size = 0  # the reply's head is yet to come
            length = request.content_length
            body = await request.content.readexactly(length) if length else b""
        except (ConnectionError, asyncio.IncompleteReadError):  # timed out or left mid-body: no one to answer
            return web.Response(status=408, headers=SERVER_HEADER)
        conn.wait(_BUSY, None)
        ours = Request(
            request.method,
            request.raw_path.split("?")[0],
            {name.lower(): value for name, value in request.headers.items()},
            body,
        )
        slow = self._slow_pool is not None and self._slow is not None and self._slow(ours)
        answer = await asyncio.get_running_loop().run_in_executor(
            self._slow_pool if slow else self._pool, self._work, ours
        )
        reply = web.Response(
            status=answer.code, body=answer.body, headers={**SERVER_HEADER, "Content-Type": answer.content_type}
        )
        conn.wait(_WRITING, self.limits.read_timeout)
        try:
            await reply.prepare(request)
            await reply.write_eof()
        except ConnectionError:  # the peer left, or didn't take the reply in time
            return reply
        conn.answered()
        return reply

    # --- workers ----------------------------------------------------------------------------------------

    def _work(self, request: Request) -> Reply:
        try:
            return self._handler(request)
        except Exception as exc:
            line, kind = _failure(exc)
            self._log_failed("%s: %s %s failed: %s", self.name, request.method, quoted(request.path), line, kind=kind)
            return Reply(500, b'{"Error": "internal error; see the server log"}')
