"""Raw HTTP/1.1 over a socket, for requests no client library will send (bad framing, stalls, floods)."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

SAFETY_TIMEOUT_S = 60.0
"""Only so that a broken server fails the test instead of hanging it; no test waits for it."""


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: dict[str, str]
    body: Any


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=SAFETY_TIMEOUT_S)
    return sock


def read_response(sock: socket.socket) -> RawResponse:
    """One response; the body is JSON (every refusal and every answer tested here is)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed before a response head: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return RawResponse(status, headers, json.loads(rest[:length]) if length else None)


def exchange(url: str, raw: bytes) -> RawResponse:
    """Send `raw` on a fresh connection and read the one answer."""
    with connect(url) as sock:
        sock.sendall(raw)
        return read_response(sock)


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed the connection (reads EOF), after any answer it sent."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
            *, length: str | None = None) -> bytes:
    """A well-formed request, except for what `length` (the Content-Length header's text) makes of it."""
    lines = [f"{method} {path} HTTP/1.1", "host: test"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    lines.append(f"content-length: {len(body) if length is None else length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body
