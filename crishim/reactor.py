"""One thread and one epoll for all of the shim's sockets.

A call through the shim is two socket hops; with a thread per direction per connection, most of
its cost was handing the interpreter lock from thread to thread. Here one thread waits on every
socket at once and does all relaying; other threads (the CreateContainer checks) hand results
back through :meth:`Reactor.call_soon`.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

RECV_SIZE = 65536
#: a peer that reads slower than this much buffered output has its source paused
HIGH_WATER = 4 << 20
_IN = select.EPOLLIN
_OUT = select.EPOLLOUT

Handler = Callable[[int], None]


class Reactor:
    def __init__(self, name: str) -> None:
        self._epoll = select.epoll()
        self._handlers: dict[int, Handler] = {}
        self._wakeup = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._wakeup, _IN)
        self._calls: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Run what was handed in so far, then stop. :meth:`close` once no other thread calls in any more."""
        self.call_soon(self._stop)
        self._thread.join(timeout)

    def close(self) -> None:
        self._closed = True
        self._epoll.close()
        os.close(self._wakeup)

    def _stop(self) -> None:
        self._stopping = True

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the reactor's thread; safe from any thread. Ignored once the reactor is closed."""
        if self._closed:
            return
        self._calls.append(fn)
        os.eventfd_write(self._wakeup, 1)

    def register(self, fd: int, events: int, handler: Handler) -> None:
        self._handlers[fd] = handler
        self._epoll.register(fd, events)

    def modify(self, fd: int, events: int) -> None:
        self._epoll.modify(fd, events)

    def unregister(self, fd: int) -> None:
        if self._handlers.pop(fd, None) is not None:
            self._epoll.unregister(fd)

    def _run(self) -> None:
        while not self._stopping:
            for fd, events in self._epoll.poll():
                if fd == self._wakeup:
                    os.eventfd_read(self._wakeup)
                    continue
                handler = self._handlers.get(fd)
                if handler is not None:
                    self._guarded(handler, events)
            while self._calls:
                self._guarded(self._calls.popleft())

    @staticmethod
    def _guarded(fn: Callable[..., None], *args: int) -> None:
        try:
            fn(*args)
        except Exception:  # one connection's bug must not stop every other connection
            log.exception("CRI shim I/O handler failed")


class Endpoint:
    """A non-blocking socket on the reactor. What arrives goes to ``on_data``; what can't be written
    at once is buffered in order and written as the peer reads. ``on_close`` runs once, whoever closes."""

    def __init__(
        self,
        reactor: Reactor,
        sock: socket.socket,
        on_data: Callable[[bytes], None],
        on_close: Callable[[], None],
        on_drain: Callable[[], None],
    ) -> None:
        sock.setblocking(False)
        self._reactor = reactor
        self._sock = sock
        self._fd = sock.fileno()
        self._on_data = on_data
        self._on_close = on_close
        self._on_drain = on_drain
        self._out: deque[bytes] = deque()
        self.buffered = 0
        self._reading = True
        self._finishing = False
        self._registered = 0
        self.closed = False
        self._update()

    @property
    def congested(self) -> bool:
        return self.buffered > HIGH_WATER

    def write(self, data: bytes) -> None:
        if self.closed or not data:
            return
        if not self._out:
            sent = self._send(data)
            if sent is None or sent == len(data):
                return
            data = data[sent:]
        self._out.append(data)
        self.buffered += len(data)
        self._update()

    def pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._update()

    def resume_reading(self) -> None:
        if not self._reading and not self.closed:
            self._reading = True
            self._update()

    def finish(self) -> None:
        """Close once what is buffered has been written (reading stops now)."""
        if not self._out:
            self.close()
            return
        self._finishing = True
        self.pause_reading()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._reactor.unregister(self._fd)
        self._registered = 0
        self._out.clear()
        self._sock.close()
        self._on_close()

    def _update(self) -> None:
        """Ask epoll for what we want now. A paused socket with nothing to write is taken out entirely,
        or a peer's hang-up would be reported over and over while we don't read."""
        if self.closed:
            return
        wanted = (_IN if self._reading else 0) | (_OUT if self._out else 0)
        if wanted == self._registered:
            return
        if not wanted:
            self._reactor.unregister(self._fd)
        elif not self._registered:
            self._reactor.register(self._fd, wanted, self._on_events)
        else:
            self._reactor.modify(self._fd, wanted)
        self._registered = wanted

    def _on_events(self, events: int) -> None:
        if events & _OUT:
            self._flush()
        if self.closed or not self._reading or not events & (_IN | select.EPOLLHUP | select.EPOLLERR):
            return
        try:
            data = self._sock.recv(RECV_SIZE)
        except BlockingIOError:
            return
        except OSError:
            self.close()
            return
        if not data:
            self.close()
            return
        self._on_data(data)

    def _flush(self) -> None:
        while self._out:
            chunk = self._out[0]
            sent = self._send(chunk)
            if not sent:
                return
            self.buffered -= sent
            if sent < len(chunk):
                self._out[0] = chunk[sent:]
                return
            self._out.popleft()
        if self._finishing:
            self.close()
            return
        self._update()
        self._on_drain()

    def _send(self, data: bytes) -> int | None:
        """Bytes the kernel took (0 when its buffer is full); None when the socket failed and is closed now."""
        try:
            return self._sock.send(data)
        except BlockingIOError:
            return 0
        except OSError:
            self.close()
            return None
