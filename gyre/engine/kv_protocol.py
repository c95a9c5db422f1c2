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
but for a call in flight rather than a finished prefill. This module imports only pydantic.
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def pack_ids(ids: list[int]) -> str:
    """Token ids as base64 of little-endian int32: at 32K ids, ~0.3 ms to pack and unpack where a JSON list
    took ~10 ms to dump and load, paid on each call that carries the prefix."""
    arr = array("i", ids)
    if sys.byteorder != "little":
        arr.byteswap()
    return base64.b64encode(arr.tobytes()).decode("ascii")


def unpack_ids(text: str) -> list[int]:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"packed ids are not valid base64: {e}") from e
    if len(raw) % 4:
        raise ValueError(f"packed ids are {len(raw)} bytes, not a multiple of 4 (int32)")
    arr = array("i")
    arr.frombytes(raw)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()


def _ids(value: Any) -> Any:
    return unpack_ids(value) if isinstance(value, str) else value


Ids = Annotated[list[int], BeforeValidator(_ids)]
"""Token ids on the KV routes: a JSON list or `pack_ids`' string (what `KvClient` sends)."""

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

    input_ids: Ids = Field(min_length=1, description="the prefix the continuing request will send")


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

    input_ids: Ids = Field(min_length=1)
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

    input_ids: Ids = Field(min_length=1, description="the prefix the continuing request will send")
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

    input_ids: Ids = Field(min_length=1)
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
