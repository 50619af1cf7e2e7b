"""Forward gRPC calls to the runtime as raw bytes, whatever the method.

Nothing is decoded: each message is passed on as the bytes that arrived, so fields and methods this
code has never heard of reach the other side intact. Methods of the CRI services we know keep their
cardinality (plain unary calls are much cheaper in grpcio); any other method is carried as a
bidirectional stream, which transports unary and streaming calls alike. Metadata, deadlines,
cancellation, status codes, details and trailing metadata (``grpc-status-details-bin`` included) go
through unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from crishim.metrics import FORWARD_LATENCY
from gpushare.pb import cri_pb2

log = logging.getLogger(__name__)

#: transform a request's bytes before forwarding; may abort the call through the context
Transform = Callable[[bytes, grpc.ServicerContext], bytes]

#: no limits of our own: the runtime and kubelet enforce theirs
MESSAGE_OPTIONS = (("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1))
#: a restarted runtime is found again within about a second
CHANNEL_OPTIONS = (
    *MESSAGE_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
#: grpcio reports "no deadline" as a huge remaining time
_NO_DEADLINE = 1e8
_HOP_BY_HOP = frozenset({"user-agent", "te", "content-type", "host"})
#: unknown method names come from clients; don't let arbitrary names grow the handler cache forever
MAX_CACHED_HANDLERS = 512


@dataclass(frozen=True, slots=True)
class Cardinality:
    client_streaming: bool
    server_streaming: bool


BIDI = Cardinality(True, True)


def known_methods() -> dict[str, Cardinality]:
    """``/package.Service/Method`` -> cardinality, for every method in the CRI proto."""
    return {
        f"/{service.full_name}/{method.name}": Cardinality(method.client_streaming, method.server_streaming)
        for service in cri_pb2.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }


def outgoing_metadata(context: grpc.ServicerContext) -> tuple[tuple[str, str | bytes], ...]:
    """The caller's metadata minus what belongs to the transport."""
    return tuple(
        (key, value)
        for key, value in context.invocation_metadata()
        if not key.startswith((":", "grpc-")) and key not in _HOP_BY_HOP
    )


def timeout_of(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None or remaining > _NO_DEADLINE else remaining


def relay_error(context: grpc.ServicerContext, err: grpc.RpcError, initial_sent: bool) -> NoReturn:
    """End the call with the runtime's status, details and metadata."""
    call: Any = err
    if not initial_sent and call.initial_metadata():
        context.send_initial_metadata(call.initial_metadata())
    context.set_trailing_metadata(call.trailing_metadata() or ())
    context.abort(call.code(), call.details() or "")


class Upstream:
    """The runtime's socket. The channel reconnects by itself, so a runtime that went away and came
    back is served again without a new channel; while it is away calls fail at once with UNAVAILABLE."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)

    def close(self) -> None:
        self.channel.close()


class Forwarder(grpc.GenericRpcHandler):
    """Serve every method by forwarding it to ``upstream``; ``transforms`` rewrite the request of
    chosen unary methods first."""

    def __init__(self, upstream: Upstream, transforms: dict[str, Transform] | None = None) -> None:
        self._upstream = upstream
        self._transforms = dict(transforms or {})
        self._known = known_methods()
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        self._lock = threading.Lock()

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method
        handler = self._handlers.get(method)
        if handler is None:
            handler = self._build(method)
            with self._lock:
                if len(self._handlers) < MAX_CACHED_HANDLERS:
                    self._handlers[method] = handler
        return handler

    def _build(self, method: str) -> grpc.RpcMethodHandler:
        kind = self._known.get(method, BIDI)
        timer = FORWARD_LATENCY.labels(method)
        channel = self._upstream.channel
        if not kind.client_streaming and not kind.server_streaming:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(channel.unary_unary(method), timer, self._transforms.get(method))
            )
        if not kind.client_streaming:
            return grpc.unary_stream_rpc_method_handler(self._streaming(channel.unary_stream(method), timer))
        if not kind.server_streaming:
            return grpc.stream_unary_rpc_method_handler(self._unary(channel.stream_unary(method), timer, None))
        return grpc.stream_stream_rpc_method_handler(self._streaming(channel.stream_stream(method), timer))

    @staticmethod
    def _unary(call: Any, timer: Any, transform: Transform | None) -> Callable[[Any, grpc.ServicerContext], bytes]:
        def handle(request: Any, context: grpc.ServicerContext) -> bytes:
            start = time.perf_counter()
            try:
                if transform is not None:
                    request = transform(request, context)
                try:
                    response, rpc = call.with_call(
                        request, timeout=timeout_of(context), metadata=outgoing_metadata(context)
                    )
                except grpc.RpcError as err:
                    relay_error(context, err, initial_sent=False)
                initial = rpc.initial_metadata()
                if initial:
                    context.send_initial_metadata(initial)
                context.set_trailing_metadata(rpc.trailing_metadata() or ())
                return response
            finally:
                timer.observe(time.perf_counter() - start)

        return handle

    @staticmethod
    def _streaming(call: Any, timer: Any) -> Callable[[Any, grpc.ServicerContext], Iterator[bytes]]:
        def handle(request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
            start = time.perf_counter()
            responses = call(request, timeout=timeout_of(context), metadata=outgoing_metadata(context))
            context.add_callback(responses.cancel)
            initial_sent = False
            try:
                initial = responses.initial_metadata()
                if initial:
                    context.send_initial_metadata(initial)
                initial_sent = True
                yield from responses
                context.set_trailing_metadata(responses.trailing_metadata() or ())
            except grpc.RpcError as err:
                relay_error(context, err, initial_sent)
            finally:
                responses.cancel()
                timer.observe(time.perf_counter() - start)

        return handle
