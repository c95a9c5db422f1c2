"""`gyre.transfer`: two Mooncake endpoints (TCP, loopback) move bytes both ways; misuse fails with errors
that name the problem."""

from __future__ import annotations

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
        with pytest.raises(TransferError, match=r"batch_transfer_sync_write to .* returned"):
            a.write(b.session_id, [Span(src.data_ptr(), 256)], [Span(0x10, 256)])
    finally:
        a.unregister(region)


def test_merge_spans_joins_only_neighbours_on_both_sides() -> None:
    local = [Span(0, 10), Span(10, 10), Span(30, 5)]
    remote = [Span(100, 10), Span(110, 10), Span(120, 5)]
    assert merge_spans(local, remote) == ([Span(0, 20), Span(30, 5)], [Span(100, 20), Span(120, 5)])
