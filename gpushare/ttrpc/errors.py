"""What goes wrong on a ttRPC connection, one type per cause, so that a caller can tell a peer's refusal
from a broken connection from a peer that breaks the protocol.

Status codes are gRPC's (``grpc.StatusCode``): ttRPC carries a google.rpc.Status in every response, as
github.com/containerd/ttrpc's services.go and client.go do.
"""

from __future__ import annotations

import grpc


class TtrpcError(Exception):
    """Any ttRPC failure."""


class ConnectionLost(TtrpcError):
    """The connection ended (the peer closed it, or it broke) before the answer came."""


class ProtocolError(TtrpcError):
    """The peer sent bytes that are no valid frame; the connection can't be trusted past them."""


class OversizedMessage(ProtocolError):
    """A message (or a multiplexer frame) longer than the protocol allows."""

    def __init__(self, what: str, length: int, limit: int) -> None:
        super().__init__(f"{what} of {length} bytes exceeds the maximum of {limit}")
        self.length = length
        self.limit = limit


class Status(TtrpcError):
    """A call's outcome other than OK: raised by a server handler to answer with that status, and by
    the client when the peer answered with one."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @property
    def number(self) -> int:
        """The code as it travels on the wire."""
        return int(self.code.value[0])

    @classmethod
    def from_wire(cls, number: int, message: str) -> Status:
        code = next((c for c in grpc.StatusCode if c.value[0] == number), grpc.StatusCode.UNKNOWN)
        return cls(code, message)


class RemoteError(Status):
    """The peer answered a call with an error status."""
