"""Wire models of Gyre's KV migration endpoints (`/gyre/kv/*`), shared by engines and the proxy's mover.

A redirected call's KV moves engine to engine; bytes never pass through the proxy. The proxy's mover uses
the pull path, one call on the critical path after the offer:
1. `POST {from}/gyre/kv/offer {input_ids, rid?}` - the sending engine looks the prefix up in its cache,
   registers the blocks that hold it, holds them for the receiver and answers their addresses (`KvOffer`).
2. `POST {to}/gyre/kv/import {input_ids, offer}` - the receiving engine checks layout and policy version,
   allocates memory for the tokens it lacks, reads them from the sender (Mooncake) and inserts them into its
   prefix cache: reserve, read and commit in one call, so the resubmitted request hits the cache.
3. `POST {from}/gyre/kv/release {offer_id}` - off the critical path: the sender lets the blocks go (at most
   `MAX_OPEN` offers stay held; the oldest is released past that).
The push path (receiver reserves, sender writes, receiver commits: three calls on the critical path):
1. `POST {to}/gyre/kv/reserve {input_ids}` - the receiving engine finds how much of the prefix it already
   caches, allocates the pages that cover the rest and registers them with its transfer endpoint.
2. `POST {from}/gyre/kv/export {input_ids, rid?, reservation}` - the sending engine checks layout and
   policy version, then writes its cached pages straight into the reserved memory (Mooncake).
3. `POST {to}/gyre/kv/commit {reservation_id, end}` - the receiver inserts the pages into its prefix
   cache under the prefix, so the resubmitted request hits the cache. `/gyre/kv/cancel` drops a reservation.
The push path is SGLang's disaggregation pattern (the receiver names destination pages, the sender writes),
but for a call in flight rather than a finished prefill. The routes that carry `input_ids` take it raw,
after their other fields, in a framed body (`KV_BODY_TYPE`), or inside a JSON body. This module imports
pydantic and numpy (no torch).
"""

from __future__ import annotations

import binascii
import json
import struct
from array import array
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, TypeAdapter, WithJsonSchema

_WIRE_ID = np.dtype("<i4")


def pack_ids(ids: Sequence[int] | np.ndarray) -> str:
    """Token ids as base64 of little-endian int32, for a JSON body (`KvClient` sends `KV_BODY_TYPE` frames):
    at 32K ids, ~0.7 ms to pack where a JSON list took ~7 ms to dump and ~3 ms to load."""
    return binascii.b2a_base64(ids_bytes(ids), newline=False).decode("ascii")


def unpack_ids(text: str) -> np.ndarray:
    """`pack_ids`' string as a read-only int64 array (the radix cache's key type: no per-id Python objects)."""
    try:
        raw = binascii.a2b_base64(text.encode("ascii"), strict_mode=True)
    except (binascii.Error, ValueError, UnicodeEncodeError) as e:
        raise ValueError(f"packed ids are not valid base64: {e}") from e
    return _wire_ids(raw, "packed ids")


def _wire_ids(raw: bytes | memoryview, what: str) -> np.ndarray:
    """Little-endian int32 bytes (`ids_bytes`) as a read-only int64 array; `what` names them in the error."""
    if len(raw) % 4:
        raise ValueError(f"{what} are {len(raw)} bytes, not a multiple of 4 (int32)")
    return _frozen(np.frombuffer(raw, dtype=_WIRE_ID).astype(np.int64))


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


_ID_LIST = TypeAdapter(list[int])


def _ids(value: Any) -> np.ndarray:
    if isinstance(value, str):
        arr = unpack_ids(value)
    elif isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        # a frame's ids are already read-only int64 (`unframe_body`): kept, not copied again
        arr = value if value.dtype == np.int64 and not value.flags.writeable else _frozen(value.astype(np.int64))
    else:
        arr = _frozen(np.asarray(_ID_LIST.validate_python(value), dtype=np.int64))
    if arr.size == 0:
        raise ValueError("input_ids must hold at least one token id")
    return arr


Ids = Annotated[
    np.ndarray,
    PlainValidator(_ids),
    PlainSerializer(pack_ids, return_type=str),
    WithJsonSchema({"type": "string", "description": "base64 of little-endian int32 token ids"}),
]
"""Token ids on the KV routes: `pack_ids`' string (what `KvClient` sends) or a JSON list, held as a read-only
int64 array. At 32K ids, a `list[int]` cost ~1.2 ms to validate and ~0.7 ms more at every radix lookup that
turned it into an array, on each engine and call."""

KV_BODY_TYPE = "application/vnd.gyre.kv-ids"
"""Content type of a KV route's framed body: `<u32 little-endian n><n bytes of JSON fields><int32 ids>`.
The fields are the request's other members; the rest of the body is its `input_ids`, raw. At 100K ids the
base64-in-JSON form cost ~3 ms to dump, ~5 ms to load and validate and ~0.5 ms to encode, per call."""
_FRAME = struct.Struct("<I")


def ids_bytes(ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian int32 bytes; OverflowError past int32. An int ndarray or an integer
    `array.array` (the proxy's call records hold `array("i")`) converts without a Python object per id: at
    100K ids a list costs ~2.3 ms, an array ~0.05 ms."""
    if isinstance(ids, array) and ids.typecode in "bBhHiIlLqQ":
        ids = np.frombuffer(ids, dtype=np.dtype(ids.typecode)) if len(ids) else np.empty(0, dtype=_WIRE_ID)
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got an array of {ids.dtype}")
        if ids.size and (ids.min() < np.iinfo(_WIRE_ID).min or ids.max() > np.iinfo(_WIRE_ID).max):
            raise OverflowError("token ids do not fit in int32")
        return ids.astype(_WIRE_ID, copy=False).tobytes()
    return np.fromiter(ids, dtype=_WIRE_ID, count=len(ids)).tobytes()


def frame_body(fields: dict[str, Any], ids: bytes) -> bytes:
    """A framed KV body (`KV_BODY_TYPE`): `fields` as JSON, then `ids_bytes(...)`."""
    head = json.dumps(fields).encode()
    return b"".join((_FRAME.pack(len(head)), head, ids))


def unframe_body(raw: bytes) -> dict[str, Any]:
    """The fields of a framed body with `input_ids` set to its ids (a read-only int64 array); ValueError
    names what is malformed."""
    if len(raw) < _FRAME.size:
        raise ValueError(f"framed KV body is {len(raw)} bytes, shorter than its {_FRAME.size}-byte header")
    (n,) = _FRAME.unpack_from(raw)
    if _FRAME.size + n > len(raw):
        raise ValueError(f"framed KV body declares {n} bytes of JSON fields but holds {len(raw) - _FRAME.size}")
    fields = json.loads(raw[_FRAME.size : _FRAME.size + n])
    if not isinstance(fields, dict):
        raise ValueError("framed KV body's fields must be a JSON object")
    if "input_ids" in fields:
        raise ValueError("framed KV body carries input_ids after its fields, not among them")
    fields["input_ids"] = _wire_ids(memoryview(raw)[_FRAME.size + n :], "framed KV body's ids")
    return fields


KvDtype = Literal["float32", "float16", "bfloat16", "float64"]
ELEMENT_SIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

KV_ORDER = "layer,kv,head,token,dim"
"""Element order of KV memory on both sides: per (layer, k|v, kv head) plane, tokens are contiguous."""


class KvLayout(BaseModel):
    """What must agree for two engines' KV pages to be interchangeable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    dtype: KvDtype
    page_size: int = Field(gt=0, description="tokens per page: the unit of export and import")
    policy_version: str = Field(description="the engine's weight version: KV is only valid under it")
    order: str = KV_ORDER

    @property
    def planes(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads

    @property
    def element_size(self) -> int:
        return ELEMENT_SIZE[self.dtype]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token in one plane."""
        return self.head_dim * self.element_size

    @property
    def bytes_per_token(self) -> int:
        return self.planes * self.token_bytes

    def layout_mismatch(self, other: KvLayout, here: str = "here") -> str | None:
        """Why pages of `self` (the sender's) cannot be used as pages of `other` (the receiver's), policy
        version aside, or None; `here` names the sender in the message."""
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size", "order"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"KV layout mismatch: {name} is {theirs!r} on the receiver but {mine!r} {here}"
        return None

    def version_mismatch(self, other: KvLayout, this: str = "this engine's KV") -> str | None:
        if self.policy_version != other.policy_version:
            return (
                f"policy version mismatch: the receiver serves {other.policy_version!r}, {this} was "
                f"computed under {self.policy_version!r}"
            )
        return None


class KvReserveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_ids: Ids = Field(description="the prefix the continuing request will send")


class KvReservation(BaseModel):
    """Receiver memory for tokens `start..end` of the prefix: plane p (see `KV_ORDER`), token t lies at
    `addr + p * plane_stride + (t - start) * layout.token_bytes`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reservation_id: str
    session_id: str = Field(description="the receiver's transfer endpoint (Mooncake session id host:port)")
    layout: KvLayout
    start: int = Field(ge=0, description="tokens the receiver already caches")
    end: int = Field(ge=0, description="prefix tokens wanted: all but the last, which is computed anyway")
    addr: int = 0
    plane_stride: int = 0

    @property
    def wanted(self) -> int:
        return max(self.end - self.start, 0)


class KvExportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_ids: Ids
    rid: str | None = Field(None, description="a paused request whose live KV should be exported too")
    reservation: KvReservation


class KvExportResult(BaseModel):
    """What the sender wrote: tokens `start..end` (`end == start` when it had nothing beyond `start`)."""

    end: int
    tokens: int
    pages: int
    bytes: int
    seconds: float


class KvCommitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reservation_id: str
    end: int = Field(ge=0, description="tokens written (the export's `end`)")


class KvCommitResult(BaseModel):
    cached_tokens: int = Field(description="leading tokens of the prefix the receiver's cache now holds")


class KvCancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reservation_id: str


# -- pull path: offer, import, release ----------------------------------------------------------------------


class KvOfferRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_ids: Ids = Field(description="the prefix the continuing request will send")
    rid: str | None = Field(None, description="a paused request whose live KV should be offered too")


class KvBlock(BaseModel):
    """One cached block of the sender: tokens `start..start + tokens` of the prefix. Element (layer, kv, head,
    token t, dim d) lies at `addr + (layer*stride[0] + kv*stride[1] + head*stride[2] + (t-start)*stride[3] + d)
    * element_size`; per plane, a block's tokens are contiguous (`stride[3] == head_dim`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    addr: int
    start: int = Field(ge=0)
    tokens: int = Field(gt=0)
    stride: tuple[int, int, int, int]


class KvOffer(BaseModel):
    """The sender holds `blocks` (tokens `0..end` of the prefix, in order) registered with its transfer
    endpoint `session_id` until `/gyre/kv/release {offer_id}`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    offer_id: str
    session_id: str
    layout: KvLayout
    end: int = Field(ge=0, description="prefix tokens offered: at most all but the last")
    blocks: list[KvBlock] = Field(default_factory=list)


class KvImportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_ids: Ids
    offer: KvOffer


class KvImportResult(BaseModel):
    """What the receiver read (tokens `start..end`; none when it cached them already) and now caches."""

    start: int
    end: int
    tokens: int
    pages: int
    bytes: int
    seconds: float = Field(description="the transfer's own seconds")
    cached_tokens: int = Field(description="leading tokens of the prefix the receiver's cache now holds")


class KvReleaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    offer_id: str
