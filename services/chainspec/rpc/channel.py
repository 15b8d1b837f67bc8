"""Client channels to chainspec services: limits, keepalive, TLS/mTLS, a shared token.

The token travels as `authorization: Bearer <token>` metadata added by a client
interceptor, so it works on plaintext channels inside a cluster as well as over TLS
(grpc's call credentials refuse insecure channels).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class ClientOptions:
    """How to reach a service. TLS is on when `tls_ca` or `tls` is set (`tls` alone
    trusts the system roots); `tls_cert`/`tls_key` add a client certificate (mTLS);
    `tls_server_name` overrides the name checked against the server certificate."""

    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    auth_token: str | None = None
    max_message_bytes: int = 64 * 2 ** 20
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    tls: bool = False
    tls_server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_cert is not None and not self.use_tls:
            raise ValueError("a client certificate needs TLS: set tls_ca (or tls)")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("auth_token must not be empty (leave it unset to disable)")
        if not 1024 <= self.max_message_bytes <= 2 ** 31 - 1:
            raise ValueError(f"max_message_bytes must be in [1024, 2^31), "
                             f"got {self.max_message_bytes}")
        if self.keepalive_time_s <= 0 or self.keepalive_timeout_s <= 0:
            raise ValueError("keepalive_time_s and keepalive_timeout_s must be > 0")

    @property
    def use_tls(self) -> bool:
        return self.tls or self.tls_ca is not None


DEFAULT_CLIENT_OPTIONS = ClientOptions()


def channel_options(opts: ClientOptions) -> list[tuple[str, int | str]]:
    out: list[tuple[str, int | str]] = [
        ("grpc.max_receive_message_length", opts.max_message_bytes),
        ("grpc.max_send_message_length", opts.max_message_bytes),
        ("grpc.keepalive_time_ms", int(opts.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(opts.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # NOTE: on a client this key bounds how often it *sends* pings without data
        # (default 5 min), which would silently stretch the keepalive period
        ("grpc.http2.min_ping_interval_without_data_ms", int(opts.keepalive_time_s * 1000)),
    ]
    if opts.tls_server_name:
        out.append(("grpc.ssl_target_name_override", opts.tls_server_name))
    return out


def channel_credentials(opts: ClientOptions) -> grpc.ChannelCredentials:
    def read(path: Path | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=read(opts.tls_ca),
                                        private_key=read(opts.tls_key),
                                        certificate_chain=read(opts.tls_cert))


def _with_token(details, token: str):
    metadata = [(k, v) for k, v in (details.metadata or ()) if k != "authorization"]
    metadata.append(("authorization", f"Bearer {token}"))
    return details._replace(metadata=metadata)


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_token(details, self.token), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with_token(details, self.token), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(_with_token(details, self.token), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(_with_token(details, self.token), request_iterator)


class _AioUnaryUnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_token(details, self.token), request)


class _AioUnaryStreamToken(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_token(details, self.token), request)


class _AioStreamUnaryToken(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_token(details, self.token), request_iterator)


class _AioStreamStreamToken(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_token(details, self.token), request_iterator)


def _aio_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """One interceptor per call kind. NOTE: grpc.aio files each interceptor under the
    first kind it implements (an if/elif chain), so one object implementing all four
    would add the token to unary-unary calls only (the streaming Generate went bare)."""
    return [_AioUnaryUnaryToken(token), _AioUnaryStreamToken(token),
            _AioStreamUnaryToken(token), _AioStreamStreamToken(token)]


def make_channel(target: str, opts: ClientOptions = DEFAULT_CLIENT_OPTIONS) -> grpc.Channel:
    """A blocking-API channel to `target` ("host:port")."""
    options = channel_options(opts)
    channel = grpc.secure_channel(target, channel_credentials(opts), options) \
        if opts.use_tls else grpc.insecure_channel(target, options)
    if opts.auth_token:
        channel = grpc.intercept_channel(channel, _TokenInterceptor(opts.auth_token))
    return channel


def make_aio_channel(target: str, opts: ClientOptions = DEFAULT_CLIENT_OPTIONS) -> grpc.aio.Channel:
    """An asyncio channel to `target` ("host:port"); create it inside the running loop."""
    options = channel_options(opts)
    interceptors = _aio_token_interceptors(opts.auth_token) if opts.auth_token else None
    if opts.use_tls:
        return grpc.aio.secure_channel(target, channel_credentials(opts), options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options, interceptors=interceptors)
