"""One Mooncake Transfer Engine endpoint: set-up, memory registration, batched reads and writes.

Facts this wrapper leans on (Mooncake 0.3.13, `mooncake.engine.TransferEngine`):
- `initialize(host, "P2PHANDSHAKE", protocol, device)` returns 0 on success; peers then address each other
  by session id `host:rpc_port`, with no metadata server.
- Only registered memory may be read or written remotely; a local buffer must be registered too.
- `batch_transfer_sync_write/read(session, local_addrs, remote_addrs, lengths)` moves many spans in one
  call and returns 0 or a negative code, but it waits by polling the batch's status in a loop that never
  pauses: the calling thread keeps a core busy for the whole transfer. The TCP transport does all its I/O
  on one asio thread per engine, so a transfer needs two cores (one per side) and the spinning caller is a
  third; on this project's 2-core machines that cost ~40% of the throughput (0.59-0.63 of a raw TCP
  stream, against 1.02-1.14 polled: `benchmarks/transfer_bench.py`). So by default
  (`EndpointConfig.wait = "sleep"`) each span is submitted as its own one-entry `batch_transfer_async_*`
  batch (`transfer_check_status`, non-blocking, sees only a batch's first request and frees it when done);
  only the oldest unfinished batch is polled, sleeping between polls for 1/16 of the time spent so far
  (50 us .. 1 ms): the wait adds at most ~6% or 1 ms to a transfer and costs no core.
- The TCP transport sends one request (span) on one connection; a peer gets 4 connection lanes
  (`MC_TCP_LANES_PER_PEER`), so several spans overlap. Each socket operation moves `MC_TCP_SLICE_SIZE`
  bytes (64 KiB); both are read from the environment once, when first used.
Mooncake is imported when the first endpoint is made: importing `gyre.transfer` costs nothing.

Invariants: a `Region` keeps the object that owns its memory alive until it is unregistered, so a
registered address never dangles; a read or write returns (or raises) only once no span of it is in flight,
except after a timeout, when the regions of the abandoned spans are kept alive for the process's life;
every failure raises `TransferError` naming the peer and the call.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gyre.errors import TransferError

Protocol = Literal["tcp", "rdma"]
Wait = Literal["sleep", "spin"]

POLL_MIN_S = 50e-6
POLL_MAX_S = 1e-3
POLL_FRACTION = 1 / 16
"""Sleep between status polls: this share of the time the transfer has taken so far, within the bounds."""


@dataclass(frozen=True, kw_only=True)
class EndpointConfig:
    """Where an endpoint listens and how it moves bytes (`tcp` on these CPUs; `rdma` with NICs)."""

    hostname: str = "127.0.0.1"
    protocol: Protocol = "tcp"
    device: str = ""
    tcp_connection_pool: bool = True
    """Reuse TCP connections between transfers (Mooncake's `MC_TCP_ENABLE_CONNECTION_POOL`; without it every
    transfer connects afresh). Mooncake reads it from the environment when its first engine starts, so it is
    set there unless the environment already names it."""
    wait: Wait = "sleep"
    """How `read`/`write` wait: `sleep` (async batches polled with sleeps: the thread gives its core to the
    transfer) or `spin` (Mooncake's `batch_transfer_sync_*`, which keeps the calling thread's core busy)."""
    timeout_s: float = 30.0
    """A transfer that has not finished after this plus 1 s per GiB (Mooncake's own sync rule) raises."""

    def __post_init__(self) -> None:
        if not self.hostname:
            raise ValueError("EndpointConfig.hostname must not be empty")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"EndpointConfig.protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if self.wait not in ("sleep", "spin"):
            raise ValueError(f"EndpointConfig.wait must be 'sleep' or 'spin', got {self.wait!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"EndpointConfig.timeout_s must be positive, got {self.timeout_s}")


@dataclass(frozen=True, slots=True)
class Span:
    """`length` bytes at `addr` in some endpoint's registered memory."""

    addr: int
    length: int


@dataclass(frozen=True, slots=True)
class Region:
    """Registered local memory; `owner` (a tensor, array, ...) is held so the memory outlives the region."""

    addr: int
    length: int
    owner: Any = field(repr=False, compare=False)

    def contains(self, span: Span) -> bool:
        return self.addr <= span.addr and span.addr + span.length <= self.addr + self.length


@dataclass(frozen=True, slots=True)
class TransferStats:
    bytes: int
    seconds: float
    spans: int

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class TransferEndpoint:
    """A Mooncake Transfer Engine of this process, reachable by peers at `session_id`. Thread-safe."""

    def __init__(self, config: EndpointConfig | None = None) -> None:
        self.config = config or EndpointConfig()
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # pragma: no cover - the package is a dependency; this names the fix
            raise TransferError(
                "the Mooncake Transfer Engine is not installed (pip package mooncake-transfer-engine-non-cuda, "
                f"Debian libibverbs1 librdmacm1 libnuma1; `make venv` installs both): {e}"
            ) from e
        c = self.config
        if c.protocol == "tcp":
            os.environ.setdefault("MC_TCP_ENABLE_CONNECTION_POOL", "1" if c.tcp_connection_pool else "0")
        self._engine = TransferEngine()
        rc = self._engine.initialize(c.hostname, "P2PHANDSHAKE", c.protocol, c.device)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({c.hostname!r}, {c.protocol!r}, {c.device!r}) returned {rc}")
        self.session_id = f"{c.hostname}:{self._engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[Region, int]] = {}  # addr -> (region, references)
        self._starts: list[int] = []  # sorted keys of _regions: a span's region is found by bisection
        self._abandoned: list[Region] = []  # regions of timed-out spans Mooncake may still write into

    def register(self, owner: Any, addr: int, length: int) -> Region:
        """Expose `length` bytes at `addr` (owned by `owner`) to peers and to this endpoint's transfers.

        Registering the same memory again (two exports sharing a cached block) counts a reference; the
        memory is unregistered when the last one is released."""
        if length <= 0:
            raise TransferError(f"cannot register {length} bytes at {addr:#x}: the length must be positive")
        with self._lock:
            known = self._regions.get(addr)
            if known is not None:
                if known[0].length != length:
                    raise TransferError(
                        f"memory at {addr:#x} is registered with {known[0].length} bytes, not {length}"
                    )
                self._regions[addr] = (known[0], known[1] + 1)
                return known[0]
            rc = self._engine.register_memory(addr, length)
            if rc != 0:
                raise TransferError(f"Mooncake register_memory({addr:#x}, {length}) returned {rc}")
            region = Region(addr, length, owner)
            self._regions[addr] = (region, 1)
            bisect.insort(self._starts, addr)
        return region

    def register_tensor(self, tensor: Any) -> Region:
        """Register a torch tensor's whole storage (views of it may then be moved)."""
        storage = tensor.untyped_storage()
        return self.register(tensor, storage.data_ptr(), storage.nbytes())

    def unregister(self, region: Region) -> None:
        """Release one registration of `region`."""
        with self._lock:
            known = self._regions.get(region.addr)
            if known is None:
                raise TransferError(f"memory at {region.addr:#x} is not registered")
            if known[1] > 1:
                self._regions[region.addr] = (known[0], known[1] - 1)
                return
            del self._regions[region.addr]
            del self._starts[bisect.bisect_left(self._starts, region.addr)]
            rc = self._engine.unregister_memory(region.addr)
        if rc != 0:
            raise TransferError(f"Mooncake unregister_memory({region.addr:#x}) returned {rc}")

    @property
    def registered(self) -> int:
        return len(self._regions)

    def write(self, peer: str, local: Sequence[Span], remote: Sequence[Span]) -> TransferStats:
        """Copy each `local[i]` into `remote[i]` of endpoint `peer` (one batched, blocking call)."""
        return self._move("write", peer, local, remote)

    def read(self, peer: str, local: Sequence[Span], remote: Sequence[Span]) -> TransferStats:
        """Copy each `remote[i]` of endpoint `peer` into `local[i]`."""
        return self._move("read", peer, local, remote)

    def _move(self, op: str, peer: str, local: Sequence[Span], remote: Sequence[Span]) -> TransferStats:
        if len(local) != len(remote):
            raise TransferError(f"{op} to {peer}: {len(local)} local spans for {len(remote)} remote spans")
        regions = self._check(op, peer, local, remote)
        if not local:
            return TransferStats(0, 0.0, 0)
        total = sum(s.length for s in local)
        start = time.perf_counter()
        if self.config.wait == "spin":
            call = self._engine.batch_transfer_sync_write if op == "write" else self._engine.batch_transfer_sync_read
            rc = call(peer, [s.addr for s in local], [s.addr for s in remote], [s.length for s in local])
            if rc != 0:
                raise TransferError(
                    f"Mooncake batch_transfer_sync_{op} to {peer} ({len(local)} spans) returned {rc}: "
                    "is the peer alive and its memory registered?"
                )
        else:
            self._move_polled(op, peer, local, remote, regions, start + self.config.timeout_s + total / (1 << 30))
        return TransferStats(total, time.perf_counter() - start, len(local))

    def _move_polled(self, op: str, peer: str, local: Sequence[Span], remote: Sequence[Span],
                     regions: list[Region], deadline: float) -> None:
        """One async batch per span (`transfer_check_status` sees only a batch's first request), polled until
        every span is done or failed: nothing is left in flight on return."""
        submit = self._engine.batch_transfer_async_write if op == "write" else self._engine.batch_transfer_async_read
        check = self._engine.transfer_check_status
        pending: list[tuple[int, int]] = []  # (batch id, span index), in submission order
        failed: list[int] = []
        refused: int | None = None
        for i, (a, b) in enumerate(zip(local, remote, strict=True)):
            batch = submit(peer, [a.addr], [b.addr], [a.length])
            if batch == 0:  # Mooncake's failure sentinel: unknown peer, or the submit was refused
                refused = i
                break
            pending.append((batch, i))
        begin = time.perf_counter()
        done = 0  # pending[:done] are finished: only the oldest unfinished batch is polled, so a wake-up
        while done < len(pending):  # costs one call however many spans are in flight
            rc = check(pending[done][0])
            if rc in (1, -1):  # completed or failed (Mooncake frees the batch); 0 and -2 mean waiting
                if rc == -1:
                    failed.append(pending[done][1])
                done += 1
                continue
            now = time.perf_counter()
            if now > deadline:
                with self._lock:
                    self._abandoned.extend(regions)
                raise TransferError(
                    f"Mooncake {op} with {peer}: {len(pending) - done} of {len(local)} spans not done before the "
                    f"timeout ({self.config.timeout_s:g} s + 1 s/GiB); they are abandoned and their local memory "
                    "is kept alive (is the peer alive?)"
                )
            time.sleep(min(POLL_MAX_S, max(POLL_MIN_S, (now - begin) * POLL_FRACTION)))
        if refused is not None:
            raise TransferError(
                f"Mooncake batch_transfer_async_{op} to {peer} refused span {refused} of {len(local)} "
                "(is the peer's session id right and the peer alive?)"
            )
        if failed:
            first = min(failed)
            raise TransferError(
                f"Mooncake {op} with {peer} failed for {len(failed)} of {len(local)} spans (first: span {first}, "
                f"{local[first].length} bytes at remote {remote[first].addr:#x}): is the peer alive and its "
                "memory registered?"
            )

    def _check(self, op: str, peer: str, local: Sequence[Span], remote: Sequence[Span]) -> list[Region]:
        """Validate the spans; the distinct local regions they lie in."""
        found: dict[int, Region] = {}
        with self._lock:
            for i, (a, b) in enumerate(zip(local, remote, strict=True)):
                if a.length != b.length or a.length <= 0:
                    raise TransferError(
                        f"{op} to {peer}: span {i} has lengths {a.length} (local), {b.length} (remote)"
                    )
                region = self._region_of(a)
                if region is None:
                    raise TransferError(
                        f"{op} to {peer}: local span {i} ({a.length} bytes at {a.addr:#x}) is not registered"
                    )
                found[region.addr] = region
        return list(found.values())

    def _region_of(self, span: Span) -> Region | None:
        """The registered region holding `span` (caller holds the lock). Mooncake refuses overlapping
        registrations, so the region starting last at or before the span is the only candidate."""
        i = bisect.bisect_right(self._starts, span.addr) - 1
        region = self._regions[self._starts[i]][0] if i >= 0 else None
        return region if region is not None and region.contains(span) else None

    def close(self) -> None:
        """Unregister everything (the Mooncake engine itself lives until the process ends)."""
        with self._lock:
            regions = [r for r, _ in self._regions.values()]
            self._regions.clear()
            self._starts.clear()
        for region in regions:
            self._engine.unregister_memory(region.addr)


def merge_spans(local: Sequence[Span], remote: Sequence[Span]) -> tuple[list[Span], list[Span]]:
    """Join neighbours that are contiguous on both sides (as SGLang's sender merges pages) - fewer requests."""
    out_l: list[Span] = []
    out_r: list[Span] = []
    for a, b in zip(local, remote, strict=True):
        if out_l and out_l[-1].addr + out_l[-1].length == a.addr and out_r[-1].addr + out_r[-1].length == b.addr:
            out_l[-1] = Span(out_l[-1].addr, out_l[-1].length + a.length)
            out_r[-1] = Span(out_r[-1].addr, out_r[-1].length + b.length)
        else:
            out_l.append(a)
            out_r.append(b)
    return out_l, out_r
