"""Helpers over grpc method handlers, shared by the server shell (`rpc/server.py`) and
the call metrics (`rpc/call_metrics.py`) that both wrap handlers."""

from __future__ import annotations

import grpc


def same_kind(handler, behavior, request_deserializer=None) -> grpc.RpcMethodHandler:
    """A method handler like `handler` (same streaming kind and codecs, unless another
    `request_deserializer` is given) running `behavior`."""
    kind = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}
    make = kind[(handler.request_streaming, handler.response_streaming)]
    return make(behavior,
                request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer)


def behavior(handler):
    """The function a method handler runs, whatever its streaming kind."""
    return (handler.unary_unary or handler.unary_stream or handler.stream_unary
            or handler.stream_stream)
