"""HTTP/2 flow control across the splice, for the streams the shim holds back.

Kubelet's frames reach the runtime unchanged, so both ends' flow-control windows agree by themselves,
except on the streams the shim holds (CreateContainer): their DATA is kept until the request is
complete and then sent, possibly rewritten and so of another length. The rules that keep both ends
exact:

* The shim grants kubelet back every byte it holds (connection and stream), as a receiver would, so
  a request larger than the runtime's windows can't stall.
* What the shim then sends the runtime counts against the runtime's windows, which the shim tracks
  exactly (it sees every byte sent to the runtime and every update the runtime grants): nothing,
  held or passed through, is sent beyond them.
* The runtime grants those bytes back in its connection window updates. Kubelet was already paid
  for them, so the shim keeps that much of the runtime's updates to itself (``owed``).

Kubelet may therefore believe in up to ``owed`` more bytes of window than the runtime has; a frame
that would overrun the runtime waits (:meth:`Windows.try_consume` says no) until the runtime's next
update. Everything here runs on the shim's one I/O thread.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpushare.crishim.frames import DEFAULT_WINDOW, MAX_WINDOW, SETTINGS_INITIAL_WINDOW_SIZE


class Windows:
    """The runtime's receive windows as the runtime sees them: the connection's and those of held streams."""

    def __init__(self) -> None:
        self.connection = DEFAULT_WINDOW
        self.owed = 0
        self._initial = DEFAULT_WINDOW
        self._streams: dict[int, int] = {}

    def track(self, stream: int) -> None:
        """Follow ``stream``'s window from now on (it was just opened)."""
        self._streams[stream] = self._initial

    def forget(self, stream: int) -> None:
        self._streams.pop(stream, None)

    def stream(self, stream: int) -> int:
        return self._streams.get(stream, 0)

    def on_settings(self, pairs: Iterable[tuple[int, int]]) -> None:
        """The runtime's SETTINGS: a new initial window moves every open stream's window by the change."""
        for key, value in pairs:
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                delta, self._initial = value - self._initial, value
                for stream in self._streams:
                    self._streams[stream] += delta

    def on_update(self, stream: int, increment: int) -> int:
        """The runtime granted ``increment`` on ``stream`` (0: the connection). Returns how much of it to
        pass on to kubelet."""
        if stream == 0:
            self.connection = min(MAX_WINDOW, self.connection + increment)
            kept = min(increment, self.owed)
            self.owed -= kept
            return increment - kept
        if stream in self._streams:
            self._streams[stream] += increment
        return increment

    def try_consume(self, size: int) -> bool:
        """Take ``size`` bytes of connection window for a frame passed through, if there is that much."""
        if size > self.connection:
            return False
        self.connection -= size
        return True

    def try_take(self, stream: int, size: int) -> bool:
        """Take window for ``size`` held bytes to be sent on ``stream``, if both windows have room. The
        runtime will grant them back, and kubelet was already paid for them."""
        if size > self.connection or size > self._streams.get(stream, 0):
            return False
        self.connection -= size
        self._streams[stream] -= size
        self.owed += size
        return True
