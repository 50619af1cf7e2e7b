"""ttRPC, containerd's small RPC protocol for local sockets, on asyncio; and NRI's multiplexing of two
ttRPC connections over one socket. No maintained Python implementation exists, so this is ours.

- :mod:`~gpushare.ttrpc.errors`: what can go wrong, each a type of its own;
- :mod:`~gpushare.ttrpc.framing`: a ttRPC message's 10-byte header and its bounds;
- :mod:`~gpushare.ttrpc.mux`: NRI's connection multiplexer, which carries the ttRPC byte streams;
- :mod:`~gpushare.ttrpc.server`: dispatching requests to async handlers by (service, method);
- :mod:`~gpushare.ttrpc.client`: concurrent calls, matched to their responses by stream id.
"""
