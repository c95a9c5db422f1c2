"""`gyre.transfer`: two Mooncake endpoints (TCP, loopback) move bytes both ways; misuse fails with errors
that name the problem."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from gyre.errors import TransferError
from gyre.transfer import EndpointConfig, Span, TransferEndpoint, merge_spans


@pytest.fixture(scope="module")
def endpoints() -> tuple[TransferEndpoint, TransferEndpoint]:
    return TransferEndpoint(), TransferEndpoint()


def test_write_and_read_move_exactly_the_named_spans(endpoints) -> None:
    a, b = endpoints
    src = torch.arange(4096, dtype=torch.float32)
    dst = torch.zeros(4096, dtype=torch.float32)
    ra, rb = a.register_tensor(src), b.register_tensor(dst)
    try:
        # two strided pieces of src land back to back in dst: elements 0..99 and 1000..1099
        local = [Span(src.data_ptr(), 400), Span(src.data_ptr() + 4000, 400)]
        remote = [Span(dst.data_ptr(), 400), Span(dst.data_ptr() + 400, 400)]
        stats = a.write(b.session_id, local, remote)
        assert (stats.bytes, stats.spans) == (800, 2)
        assert torch.equal(dst[:100], src[:100]) and torch.equal(dst[100:200], src[1000:1100])
        assert not dst[200:].any()
        back = torch.zeros(200)
        rback = a.register_tensor(back)
        a.read(b.session_id, [Span(back.data_ptr(), 800)], [Span(dst.data_ptr(), 800)])
        assert torch.equal(back, dst[:200])
        a.unregister(rback)
    finally:
        a.unregister(ra)
        b.unregister(rb)
    assert a.registered == b.registered == 0


def test_registration_is_counted_and_misuse_is_named(endpoints) -> None:
    a, b = endpoints
    t = torch.zeros(256)
    r1, r2 = a.register_tensor(t), a.register_tensor(t)
    assert r1 == r2 and a.registered == 1
    a.unregister(r1)
    assert a.registered == 1
    a.unregister(r2)
    with pytest.raises(TransferError, match="is not registered"):
        a.unregister(r2)
    with pytest.raises(TransferError, match=r"local span 0 .* is not registered"):
        a.write(b.session_id, [Span(t.data_ptr(), 64)], [Span(1, 64)])
    with pytest.raises(TransferError, match="1 local spans for 0 remote spans"):
        a.write(b.session_id, [Span(t.data_ptr(), 64)], [])
    with pytest.raises(TransferError, match="length must be positive"):
        a.register(t, t.data_ptr(), 0)
    with pytest.raises(ValueError, match="protocol must be 'tcp' or 'rdma'"):
        EndpointConfig(protocol="udp")  # type: ignore[arg-type]


def test_a_transfer_to_unregistered_remote_memory_fails(endpoints) -> None:
    a, b = endpoints
    src = torch.ones(64)
    region = a.register_tensor(src)
    try:
        with pytest.raises(TransferError, match=r"Mooncake write with .* failed for 1 of 1 spans"):
            a.write(b.session_id, [Span(src.data_ptr(), 256)], [Span(0x10, 256)])
    finally:
        a.unregister(region)


def test_merge_spans_joins_only_neighbours_on_both_sides() -> None:
    local = [Span(0, 10), Span(10, 10), Span(30, 5)]
    remote = [Span(100, 10), Span(110, 10), Span(120, 5)]
    assert merge_spans(local, remote) == ([Span(0, 20), Span(30, 5)], [Span(100, 20), Span(120, 5)])


@pytest.mark.parametrize("wait", ["sleep", "spin"])
def test_both_waits_move_many_spans_over_all_lanes(wait: str) -> None:
    a, b = TransferEndpoint(EndpointConfig(wait=wait)), TransferEndpoint()  # type: ignore[arg-type]
    src = torch.arange(1 << 18, dtype=torch.int32)  # 1 MiB as 64 spans of 16 KiB, written in reverse order
    dst = torch.zeros_like(src)
    ra, rb = a.register_tensor(src), b.register_tensor(dst)
    try:
        n, size = 64, 16384
        local = [Span(src.data_ptr() + i * size, size) for i in range(n)]
        remote = [Span(dst.data_ptr() + (n - 1 - i) * size, size) for i in range(n)]
        stats = a.write(b.session_id, local, remote)
        assert (stats.bytes, stats.spans) == (n * size, n)
        assert torch.equal(dst.view(n, -1), src.view(n, -1).flip(0))
        back = torch.zeros_like(src)
        rback = a.register_tensor(back)
        a.read(b.session_id, [Span(back.data_ptr(), n * size)], [Span(dst.data_ptr(), n * size)])
        assert torch.equal(back, dst)
        a.unregister(rback)
    finally:
        a.unregister(ra)
        b.unregister(rb)


def test_spans_are_checked_against_the_right_region(endpoints) -> None:
    a, b = endpoints
    pieces = [torch.full((256,), float(i)) for i in range(3)]
    dst = torch.zeros(256)
    regions, rb = [a.register_tensor(t) for t in pieces], b.register_tensor(dst)
    try:
        middle = pieces[1]
        a.write(b.session_id, [Span(middle.data_ptr() + 512, 512)], [Span(dst.data_ptr(), 512)])
        assert dst[:128].eq(1).all() and not dst[128:].any()
        with pytest.raises(TransferError, match=r"local span 0 .* is not registered"):  # past its region
            a.write(b.session_id, [Span(middle.data_ptr() + 512, 1024)], [Span(dst.data_ptr(), 1024)])
        with pytest.raises(TransferError, match=r"register_memory\(.*\) returned"):  # Mooncake refuses nested regions
            a.register(middle, middle.data_ptr() + 256, 256)
    finally:
        for r in regions:
            a.unregister(r)
        b.unregister(rb)


def test_an_unknown_peer_is_named() -> None:
    a = TransferEndpoint()
    src = torch.ones(64)
    region = a.register_tensor(src)
    try:
        with pytest.raises(TransferError, match=r"to 127\.0\.0\.1:1 refused span 0 of 1"):
            a.write("127.0.0.1:1", [Span(src.data_ptr(), 256)], [Span(0x1000, 256)])
    finally:
        a.unregister(region)


PEER = """
import sys, torch
from gyre.transfer import TransferEndpoint
ep = TransferEndpoint()
t = torch.ones(1 << 18)
ep.register_tensor(t)
print(ep.session_id, t.data_ptr(), flush=True)
sys.stdin.read()
"""


def test_a_stopped_peer_times_out_and_the_local_memory_is_kept_alive() -> None:
    """A peer that never answers (SIGSTOP: not a matter of timing) fails the read after the timeout."""
    peer = subprocess.Popen([sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None
        session, addr = peer.stdout.readline().split()
        a = TransferEndpoint()
        dst = torch.zeros(1 << 18)
        region = a.register_tensor(dst)
        a.read(session, [Span(dst.data_ptr(), 4096)], [Span(int(addr), 4096)])  # connected, lanes open
        assert dst[:1024].eq(1).all()
        a.config = EndpointConfig(timeout_s=0.2)  # only now: the warm-up above must not race a deadline
        os.kill(peer.pid, signal.SIGSTOP)
        _, status = os.waitpid(peer.pid, os.WUNTRACED)  # the stop is asynchronous: wait until every thread is
        assert os.WIFSTOPPED(status)  # stopped, or its I/O thread may still serve the read below
        with pytest.raises(TransferError, match=rf"read with {session}: 1 of 1 spans not done before the timeout"):
            a.read(session, [Span(dst.data_ptr(), 1 << 20)], [Span(int(addr), 1 << 20)])
        assert region in a._abandoned  # Mooncake may still write into it: it must not be freed
        a.unregister(region)
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        peer.kill()
        peer.wait(30)
