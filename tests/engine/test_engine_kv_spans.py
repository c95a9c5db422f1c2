"""The spans a KV export sends, applied as plain memory copies, rebuild exactly the receiver's tensor - for
any shape of the sender's radix tree (prefix split over several edges) and any cached start on the receiver."""

from __future__ import annotations

import ctypes
from array import array

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.engine.kv_protocol import (
    KvLayout,
    KvOfferRequest,
    KvReservation,
    frame_body,
    ids_bytes,
    pack_ids,
    unframe_body,
    unpack_ids,
)
from gyre.engine.local.kv import KVShape, SequenceKV
from gyre.engine.local.kv_port import HUGE_PAGE, KvPort, receive_buffer
from gyre.engine.local.radix import RadixCache
from gyre.transfer import EndpointConfig

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=4)
LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", page_size=4, policy_version="v")


def _kv_of(ids: list[int]) -> SequenceKV:
    """KV whose every element names its position, layer, k|v, head and dim: misplaced bytes show."""
    n = len(ids)
    pos = torch.arange(n, dtype=torch.float32).view(1, 1, 1, n, 1)
    tag = (
        torch.arange(2).view(2, 1, 1, 1, 1) * 0.5
        + torch.arange(2).view(1, 2, 1, 1, 1) * 0.25
        + torch.arange(2).view(1, 1, 2, 1, 1) * 0.125
        + torch.arange(4).view(1, 1, 1, 1, 4) * 0.01
    )
    kv = SequenceKV(SHAPE, n)
    kv.append_segment(pos * 10 + tag)
    return kv


@settings(max_examples=60, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 63), max_size=4),
    start=st.integers(0, 63),
    length=st.integers(2, 64),
)
def test_export_spans_rebuild_the_prefix(cuts: list[int], start: int, length: int) -> None:
    base = list(range(1, 65))
    cache = RadixCache(1 << 20)
    for cut in cuts:  # earlier, shorter requests (with a diverging token) split the edges at `cut`
        branch = [*base[:cut], 999]
        cache.insert(branch, _kv_of(branch))
    cache.insert(base, _kv_of(base))
    ids = base[:length]
    end = length - 1
    start = min(start, end)
    match = cache.match(ids, limit=end)
    assert match.length == end
    if end == start:
        return
    dst = torch.zeros(2, 2, 2, end - start, 4)
    res = KvReservation(
        reservation_id="r", session_id="peer", layout=LAYOUT, start=start, end=end,
        addr=dst.data_ptr(), plane_stride=(end - start) * LAYOUT.token_bytes,
    )
    port = KvPort(None, SHAPE, LAYOUT.page_size, EndpointConfig())  # type: ignore[arg-type]  # no scheduler needed
    local, remote = port.export_spans(match.segments, res, end)
    for a, b in zip(local, remote, strict=True):
        ctypes.memmove(b.addr, a.addr, a.length)
    expected = _kv_of(base).buf[:, :, :, start:end]
    assert torch.equal(dst, expected)
    assert sum(s.length for s in local) == (end - start) * LAYOUT.bytes_per_token


def test_layout_mismatches_name_the_field() -> None:
    other = LAYOUT.model_copy(update={"num_kv_heads": 4})
    assert LAYOUT.layout_mismatch(other) == "KV layout mismatch: num_kv_heads is 4 on the receiver but 2 here"
    assert "dtype is 'bfloat16'" in (LAYOUT.layout_mismatch(LAYOUT.model_copy(update={"dtype": "bfloat16"})) or "")
    newer = LAYOUT.model_copy(update={"policy_version": "w"})
    assert LAYOUT.layout_mismatch(newer) is None
    assert LAYOUT.version_mismatch(newer) == (
        "policy version mismatch: the receiver serves 'w', this engine's KV was computed under 'v'"
    )
    assert LAYOUT.bytes_per_token == 2 * 2 * 2 * 4 * 4


@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=300))
def test_packed_ids_round_trip_and_either_form_is_accepted(ids: list[int]) -> None:
    assert unpack_ids(pack_ids(ids)).tolist() == ids
    assert pack_ids(np.asarray(ids, dtype=np.int64)) == pack_ids(ids)
    for form in (pack_ids(ids), ids):
        got = KvOfferRequest.model_validate({"input_ids": form}).input_ids
        assert got.dtype == np.int64 and not got.flags.writeable and got.tolist() == ids
    assert KvOfferRequest.model_validate({"input_ids": ids}).model_dump()["input_ids"] == pack_ids(ids)


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300), st.sampled_from("ilq"))
def test_ids_bytes_of_an_int_array_equals_that_of_the_list(ids: list[int], typecode: str) -> None:
    """The proxy hands the mover its call record's `array("i")`; every integer form gives the same bytes."""
    want = ids_bytes(ids)
    assert ids_bytes(array(typecode, ids)) == want == ids_bytes(np.asarray(ids, dtype=np.int64))
    assert np.frombuffer(want, dtype="<i4").tolist() == ids


def test_ids_beyond_int32_are_refused_when_packed() -> None:
    with pytest.raises(OverflowError):
        pack_ids([2**31])
    with pytest.raises(OverflowError):
        pack_ids(np.asarray([-(2**31) - 1]))
    with pytest.raises(OverflowError):
        ids_bytes(array("q", [1, 2**31]))
    with pytest.raises(TypeError, match="must be integers"):
        ids_bytes(np.asarray([1.5, 2.0]))


def test_bad_packed_ids_are_named() -> None:
    with pytest.raises(ValueError, match="not valid base64"):
        KvOfferRequest.model_validate({"input_ids": "***"})
    with pytest.raises(ValueError, match="not a multiple of 4"):
        KvOfferRequest.model_validate({"input_ids": "AAA="})
    with pytest.raises(ValueError, match="at least one token id"):
        KvOfferRequest.model_validate({"input_ids": ""})
    with pytest.raises(ValueError, match="at least one token id"):
        KvOfferRequest.model_validate({"input_ids": []})
    with pytest.raises(ValueError, match="fractional part"):
        KvOfferRequest.model_validate({"input_ids": [1.5]})


def test_receive_buffers_are_zeroed_aligned_pages_of_the_right_shape() -> None:
    pages = receive_buffer(SHAPE, 1000)
    assert pages.shape == (2, 2, 2, 1000, 4) and pages.dtype == torch.float32 and pages.is_contiguous()
    assert pages.data_ptr() % HUGE_PAGE == 0 and not pages.any()
    pages.fill_(1.0)  # writable, and the mapping outlives the function that made it
    assert pages.sum().item() == pages.numel()


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300), st.dictionaries(st.sampled_from("abc"), st.integers()))
def test_a_framed_body_carries_its_fields_and_ids(ids: list[int], fields: dict) -> None:
    got = unframe_body(frame_body(fields, ids_bytes(ids)))
    assert got.pop("input_ids").tolist() == ids and got == fields


def test_malformed_framed_bodies_are_named() -> None:
    body = frame_body({"rid": None}, ids_bytes([1, 2]))
    with pytest.raises(ValueError, match="shorter than its 4-byte header"):
        unframe_body(body[:3])
    with pytest.raises(ValueError, match="declares 13 bytes of JSON fields"):
        unframe_body(body[:10])
    with pytest.raises(ValueError, match="not a multiple of 4"):
        unframe_body(body[:-1])
    with pytest.raises(ValueError, match="not among them"):
        unframe_body(frame_body({"input_ids": [1]}, b""))
