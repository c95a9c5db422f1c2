"""Where each process of a cluster run listens, and the address its peers reach it at.

Every server of a run (the controller's hub, a cell's engine, its Mooncake endpoints and the core's Trainer
service, the proxy) binds ``bind`` and names itself to its peers by ``advertise``. One config file serves
every host, so both come from ``[cluster]`` and may be overridden per process (``gyre cell --bind
--advertise``; a Ray launcher passes the node's address). Rules, in one place:

- ``advertise`` is never a wildcard (``0.0.0.0``, ``::``): a peer cannot connect to "every interface".
- Unset, it is ``bind`` when that is one concrete address; with a wildcard ``bind`` a process that knows
  its controller advertises the local address the kernel routes toward the controller (the interface the
  controller's peers share with it); the controller itself then needs ``advertise`` set.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from gyre.errors import ConfigError

WILDCARDS = frozenset({"0.0.0.0", "::", "[::]", ""})


@dataclass(frozen=True)
class NodeAddress:
    """``bind``: the interface a server listens on; ``advertise``: the host its peers dial."""

    bind: str
    advertise: str

    def endpoint(self, port: int) -> str:
        """``host:port`` for peers (IPv6 in brackets, as gRPC and URLs want it)."""
        return f"{bracket(self.advertise)}:{port}"

    def listen(self, port: int = 0) -> str:
        """``host:port`` to bind."""
        return f"{bracket(self.bind)}:{port}"


def bracket(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host.strip("[]")).version == 6 else host
    except ValueError:  # a host name
        return host


def split_host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets) -> (host, port); ConfigError naming the address otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def route_source(host: str) -> str:
    """The local address the kernel would send from toward ``host`` (no packet is sent: a UDP connect only
    picks the route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
        except OSError as error:
            raise ConfigError(f"no route to {host} to find this host's advertised address: {error}") from error
        return probe.getsockname()[0]


def resolve(bind: str, advertise: str = "", *, controller: str | None = None) -> NodeAddress:
    """The process's `NodeAddress` (module docstring); ``controller`` is its ``HOST:PORT`` (None: this is the
    controller)."""
    if advertise in WILDCARDS and advertise:
        raise ConfigError(f"cluster.advertise {advertise!r} is a wildcard: name an address peers can connect to")
    if advertise:
        return NodeAddress(bind, advertise)
    if bind not in WILDCARDS:
        return NodeAddress(bind, bind)
    if controller is None:
        raise ConfigError(f"cluster.bind {bind!r} listens on every interface: set cluster.advertise (or "
                          "`gyre run --advertise`) to the address the cells and the proxy reach the controller at")
    return NodeAddress(bind, route_source(split_host_port(controller)[0]))
