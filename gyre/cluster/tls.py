"""gRPC over TLS for networks that are not trusted (``[cluster.tls]``), or plaintext where they are.

One place decides how every server of the control plane (the hub, the core's Trainer service) listens and
how every client (links, satellites, the log reader) dials. TLS authenticates the servers to their clients and
encrypts the run secret each call carries; the secret (not a client certificate) still authenticates the
clients. Files are read when a server or channel is made, on the host that makes it: each host holds its own
key and certificate at the configured paths and the CA that signed the others'.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from pydantic import Field

from gyre.config import _Section
from gyre.errors import ConfigError


class TlsSection(_Section):
    """PEM files on each host: ``ca`` signs every server's certificate; ``cert``/``key`` are this host's."""

    ca: Path = Field(description="CA certificate clients verify servers with")
    cert: Path = Field(description="this host's server certificate (its subject names the advertised address)")
    key: Path = Field(description="this host's private key")
    server_name: str = Field("", description="name to verify instead of the dialled host (a shared certificate)")


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ConfigError(f"cluster.tls.{what}: cannot read {path}: {error}") from error


def add_port(server: Any, address: str, tls: TlsSection | None) -> int:
    """Bind ``address`` on ``server`` (grpc or grpc.aio); returns the port (0: could not bind)."""
    if tls is None:
        return server.add_insecure_port(address)
    credentials = grpc.ssl_server_credentials([(_read(tls.key, "key"), _read(tls.cert, "cert"))])
    return server.add_secure_port(address, credentials)


def _secure(tls: TlsSection, options: Sequence[tuple[str, Any]]) -> tuple[grpc.ChannelCredentials, list]:
    opts = list(options)
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca, "ca")), opts


def channel(address: str, tls: TlsSection | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    credentials, opts = _secure(tls, options)
    return grpc.secure_channel(address, credentials, options=opts)


def aio_channel(address: str, tls: TlsSection | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    credentials, opts = _secure(tls, options)
    return grpc.aio.secure_channel(address, credentials, options=opts)
