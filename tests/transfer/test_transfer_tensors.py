"""`gyre.transfer.tensors`: weights published into alternating registered buffers and pulled by a second real
Mooncake endpoint (TCP, loopback); gradients written into per-satellite slots and summed on the core."""

from __future__ import annotations

import pytest
import torch

from gyre.errors import TransferError
from gyre.transfer import TransferEndpoint
from gyre.transfer.tensors import (
    GradientSlots,
    SlotDescriptor,
    TensorManifest,
    WeightsPublisher,
    WeightsPuller,
    pull_weights,
    write_gradients,
)


@pytest.fixture(scope="module")
def endpoints() -> tuple[TransferEndpoint, TransferEndpoint]:
    return TransferEndpoint(), TransferEndpoint()


def named(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(37, 16, generator=g),
        "layer.bias": torch.randn(3, generator=g, dtype=torch.float64),  # odd size: the next offset is aligned
        "norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "steps": torch.arange(5, dtype=torch.int64) + seed,
    }


def test_manifest_round_trips_through_json_with_aligned_offsets() -> None:
    m = TensorManifest.plan(named(0), version=3)
    assert [s.offset % 64 for s in m.tensors] == [0] * 4
    assert TensorManifest.from_json(m.to_json()) == m
    with pytest.raises(TransferError, match="not a tensor manifest"):
        TensorManifest.from_json(b"{}")
    with pytest.raises(TransferError, match="appears twice"):
        TensorManifest.plan([("a", torch.zeros(1)), ("a", torch.zeros(1))])


def test_pull_returns_the_published_tensors_by_name(endpoints) -> None:
    core, peer = endpoints
    publisher = WeightsPublisher(core)
    try:
        manifest = publisher.publish(1, named(1))
        pulled = pull_weights(peer, core.session_id, manifest.to_json())
        assert set(pulled) == set(named(1))
        for name, t in named(1).items():
            assert pulled[name].dtype == t.dtype and torch.equal(pulled[name], t)
        assert publisher.manifest() == manifest and publisher.manifest(1) == manifest
    finally:
        publisher.close()
    assert core.registered == 0 and peer.registered == 0


def test_two_versions_are_held_and_an_older_one_is_refused(endpoints) -> None:
    core, peer = endpoints
    publisher = WeightsPublisher(core)
    try:
        v1 = publisher.publish(1, named(1))
        v2 = publisher.publish(2, named(2))
        assert publisher.versions == [1, 2]
        # V+1 went to the other buffer: a reader of V is untouched
        assert torch.equal(pull_weights(peer, core.session_id, v1)["embed.weight"], named(1)["embed.weight"])
        publisher.publish(3, named(3))  # reuses version 1's buffer
        assert publisher.versions == [2, 3]
        with pytest.raises(TransferError, match="version 1 is not held by the publisher"):
            publisher.manifest(1)
        with pytest.raises(TransferError, match=r"version 1 is no longer held .*holding version 3"):
            pull_weights(peer, core.session_id, v1)  # a stale manifest: the header says the buffer moved on
        assert torch.equal(pull_weights(peer, core.session_id, v2)["steps"], named(2)["steps"])
        with pytest.raises(TransferError, match="version 3 is already published"):
            publisher.publish(2, named(2))
    finally:
        publisher.close()


def test_a_puller_reuses_one_registered_buffer_across_versions(endpoints) -> None:
    core, peer = endpoints
    publisher, puller = WeightsPublisher(core), WeightsPuller(peer)
    try:
        for version in (1, 2, 3):
            pulled = puller.pull(core.session_id, publisher.publish(version, named(version)).to_json())
            assert all(torch.equal(pulled[n], t) for n, t in named(version).items())
            assert peer.registered == 1
    finally:
        puller.close()
        publisher.close()
    assert peer.registered == 0


def test_a_torn_read_fails_its_checksum(endpoints) -> None:
    core, peer = endpoints
    publisher = WeightsPublisher(core)
    try:
        manifest = publisher.publish(1, named(1))
        # the bytes change under an unchanged header (what an overwrite racing the read would leave)
        publisher._buffers[0].data[64 + 10] ^= 0xFF
        with pytest.raises(TransferError, match=r"chunk\(s\) \[0\] of 1 fail their checksum"):
            pull_weights(peer, core.session_id, manifest)
        unpublished = TensorManifest.plan(named(1))
        with pytest.raises(TransferError, match="never published"):
            pull_weights(peer, core.session_id, unpublished)
    finally:
        publisher.close()


def test_gradients_written_into_slots_are_summed_on_the_core(endpoints) -> None:
    core, peer = endpoints
    own = [torch.ones(4, 3), torch.full((5,), 2.0)]
    slots = GradientSlots.for_buffers(core, own)
    try:
        a = SlotDescriptor.from_json(slots.allocate("sat-a").to_json())
        b = slots.allocate("sat-b")
        assert slots.allocate("sat-a") == a  # a second join keeps the slot
        ga = [torch.arange(12.0).view(4, 3), torch.arange(5.0)]
        gb = [torch.full((4, 3), -1.0), torch.full((5,), 0.5)]
        assert write_gradients(peer, core.session_id, a.to_json(), ga) == 17 * 4
        write_gradients(peer, core.session_id, b, gb)
        slots.sum_into(own, ["sat-a"])  # only the slots that reported are added
        assert torch.equal(own[0], 1 + torch.arange(12.0).view(4, 3)) and torch.equal(own[1], 2 + torch.arange(5.0))
        slots.sum_into(own, ["sat-b"])
        assert torch.equal(own[1], 2.5 + torch.arange(5.0))
        with pytest.raises(TransferError, match="do not fit slot 'sat-a'"):
            write_gradients(peer, core.session_id, a, [torch.zeros(3)])
        slots.free("sat-b")
        with pytest.raises(TransferError, match="no gradient slot for 'sat-b'"):
            slots.sum_into(own, ["sat-b"])
    finally:
        slots.close()
    assert core.registered == 0
