"""Weights and gradients over Mooncake: named tensors packed into one flat registered buffer.

Why one flat buffer: a Mooncake transfer moves spans of registered memory, and per-tensor registrations and
requests (hundreds of small tensors in a real model) cost more than the bytes. Packing every tensor at an
aligned offset of one buffer makes a pull a handful of large batched reads, and the receiver gets its
tensors back as views, with no per-tensor copy.

- ``TensorManifest``: the layout (names, dtypes, shapes, offsets, total bytes), the version it holds, where
  the bytes are registered on the publisher (``addr``, and the ``header_addr`` of the slot's header) and a
  CRC32C per chunk, to and from JSON bytes (``WeightsRef.manifest`` carries it).
- ``WeightsPublisher`` (the core): ``publish(version, named_tensors)`` copies into one of **two alternating
  registered buffers**, so the version a peer is reading (V) is never overwritten by the next publish
  (V+1): only the publish after that (V+2) reuses V's buffer. A pull of a version the publisher no longer
  holds is refused with ``TransferError``, on the publisher (``manifest``) and on the reader (each buffer
  starts with a header naming the version it holds, read before and after the data: a seqlock).
- ``pull_weights(endpoint, peer_session, manifest)``: batched reads into a local registered buffer, the
  header check and the chunk checksums verified, then views by name — a torn read is an error, never
  silent garbage.
- ``GradientSlots`` (the core): one registered flat fp32 slot per satellite, allocated on join and freed on
  leave; the satellite writes its summed gradients there (``write_gradients``), and the core adds the slots
  of the satellites that reported into its own gradients (``sum_into``). No process group: a satellite can
  come and go between micro-steps, and a dead one leaves only an unread slot.

Everything here is CPU memory (the TCP transport); on GPUs the same layout would be registered device memory.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import crc32c
import torch

from gyre.errors import TransferError
from gyre.transfer.endpoint import Region, Span, TransferEndpoint

ALIGN = 64
"""Every tensor starts at a multiple of this many bytes (cache lines; any dtype's alignment)."""
CHUNK_BYTES = 16 << 20
"""Bytes per read request and per checksum: large enough that Mooncake's per-request cost vanishes, small
enough that one chunk failing its checksum names where."""
READ_GROUP = 2
"""Chunks per batched read while pulling weights: the checksum of one group overlaps the read of the next."""
HEADER_BYTES = ALIGN
"""A publisher buffer's header: int64 version held (-1 while being written), int64 generation."""
WRITING = -1

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TransferError(f"tensors of dtype {dtype} cannot be moved (supported: {sorted(_DTYPES)})") from None


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorSpec:
    """Where one named tensor lives in the flat buffer (``offset`` from the data start)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class TensorManifest:
    """A flat buffer's layout and, once published, its version, registered address and checksums."""

    tensors: tuple[TensorSpec, ...]
    total_bytes: int
    version: int = 0
    addr: int = 0
    """Address of the data on the publisher (0: not published)."""
    header_addr: int = 0
    """Address of the publisher buffer's header (its version word)."""
    chunk_bytes: int = CHUNK_BYTES
    checksums: tuple[int, ...] = ()
    """CRC32C of each ``chunk_bytes`` piece of the data."""

    @classmethod
    def plan(cls, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
             version: int = 0) -> TensorManifest:
        """The layout of ``named`` packed in order, each tensor at an aligned offset."""
        items = named.items() if isinstance(named, Mapping) else named
        specs: list[TensorSpec] = []
        offset = 0
        seen: set[str] = set()
        for name, t in items:
            if name in seen:
                raise TransferError(f"tensor name {name!r} appears twice in one manifest")
            seen.add(name)
            nbytes = t.numel() * t.element_size()
            specs.append(TensorSpec(name, dtype_name(t.dtype), tuple(int(d) for d in t.shape), offset, nbytes))
            offset = _align(offset + nbytes)
        if not specs:
            raise TransferError("a manifest needs at least one tensor")
        return cls(tuple(specs), max(offset, ALIGN), version)

    def same_layout(self, other: TensorManifest) -> bool:
        return self.tensors == other.tensors and self.total_bytes == other.total_bytes

    def chunks(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of each chunk of the data."""
        return [(o, min(self.chunk_bytes, self.total_bytes - o)) for o in range(0, self.total_bytes, self.chunk_bytes)]

    def views(self, data: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name -> tensor view into ``data`` (a uint8 tensor of ``total_bytes``, this layout)."""
        if data.dtype != torch.uint8 or data.numel() < self.total_bytes:
            raise TransferError(f"a buffer of {data.numel()} {data.dtype} cannot hold a {self.total_bytes}-byte layout")
        return {s.name: data[s.offset:s.offset + s.nbytes].view(_DTYPES[s.dtype]).view(s.shape) for s in self.tensors}

    def to_json(self) -> bytes:
        return json.dumps({
            "version": self.version, "addr": self.addr, "header_addr": self.header_addr,
            "total_bytes": self.total_bytes, "chunk_bytes": self.chunk_bytes, "checksums": list(self.checksums),
            "tensors": [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.tensors],
        }, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> TensorManifest:
        try:
            raw = json.loads(data)
            tensors = tuple(TensorSpec(str(n), str(d), tuple(int(x) for x in shape), int(o), int(b))
                            for n, d, shape, o, b in raw["tensors"])
            manifest = cls(tensors, int(raw["total_bytes"]), int(raw["version"]), int(raw["addr"]),
                           int(raw["header_addr"]), int(raw["chunk_bytes"]), tuple(int(c) for c in raw["checksums"]))
        except (ValueError, KeyError, TypeError) as e:
            raise TransferError(f"not a tensor manifest: {e}") from e
        for s in tensors:
            if s.dtype not in _DTYPES:
                raise TransferError(f"manifest tensor {s.name!r} has unknown dtype {s.dtype!r}")
            if s.offset < 0 or s.offset + s.nbytes > manifest.total_bytes:
                raise TransferError(f"manifest tensor {s.name!r} lies outside the {manifest.total_bytes}-byte buffer")
        return manifest


def pack(manifest: TensorManifest, data: torch.Tensor,
         named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy ``named`` into ``data`` at ``manifest``'s offsets (names, dtypes and shapes must match)."""
    views = manifest.views(data)
    items = dict(named.items() if isinstance(named, Mapping) else named)
    if set(items) != set(views):
        extra, missing = sorted(set(items) - set(views)), sorted(set(views) - set(items))
        raise TransferError(f"tensors do not match the layout: extra {extra[:5]}, missing {missing[:5]}")
    with torch.no_grad():
        for name, view in views.items():
            t = items[name]
            if t.dtype != view.dtype or tuple(t.shape) != tuple(view.shape):
                raise TransferError(f"tensor {name!r} is {t.dtype} {tuple(t.shape)}, the layout says "
                                    f"{view.dtype} {tuple(view.shape)}")
            view.copy_(t.detach())


def checksums(manifest: TensorManifest, data: torch.Tensor) -> tuple[int, ...]:
    """CRC32C of each chunk of ``data`` (the `crc32c` package the log uses: hardware instructions, ~3.6x zlib's
    CRC-32 here, and it releases the GIL for large buffers)."""
    raw = memoryview(data[:manifest.total_bytes].numpy())
    return tuple(crc32c.crc32c(raw[o:o + n]) for o, n in manifest.chunks())


def _header(data: torch.Tensor) -> torch.Tensor:
    return data[:HEADER_BYTES].view(torch.int64)


# -- weights: the core publishes, peers pull ------------------------------------------------------------------


@dataclass
class _Buffer:
    data: torch.Tensor  # uint8: header then data
    region: Region
    manifest: TensorManifest | None = None
    generation: int = 0


class WeightsPublisher:
    """The core's published weights in two alternating registered buffers (versions V and V-1 held).

    Why two: a peer reads version V with one-sided Mooncake reads the publisher never sees, so the
    publisher cannot wait for it. Publishing V+1 writes the *other* buffer, so a read of V that started
    before it is never torn; only V+2 reuses V's buffer. By then V is two versions old: ``manifest(V)``
    refuses it, and a reader still at it finds the header changed and raises ``TransferError``.
    Thread-safe (publish on the training thread, manifests from the Trainer service's loop)."""

    def __init__(self, endpoint: TransferEndpoint) -> None:
        self.endpoint = endpoint
        self._buffers: list[_Buffer] = []
        self._next = 0
        self._lock = threading.Lock()
        self.generation = 0

    def publish(self, version: int,
                named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> TensorManifest:
        """Copy ``named`` into the buffer not holding the latest version; returns its manifest."""
        items = list(named.items() if isinstance(named, Mapping) else named)
        layout = TensorManifest.plan(items, version)
        with self._lock:
            held = [b.manifest.version for b in self._buffers if b.manifest is not None]
            if held and version < max(held):
                raise TransferError(f"cannot publish version {version}: version {max(held)} is already published")
            if len(self._buffers) < 2:
                data = torch.zeros(HEADER_BYTES + layout.total_bytes, dtype=torch.uint8)
                _header(data)[0] = WRITING
                self._buffers.append(_Buffer(data, self.endpoint.register_tensor(data)))
                index = len(self._buffers) - 1
            else:
                index = self._next
            buffer = self._buffers[index]
            if buffer.data.numel() != HEADER_BYTES + layout.total_bytes:  # the layout changed: a new buffer
                self.endpoint.unregister(buffer.region)
                data = torch.zeros(HEADER_BYTES + layout.total_bytes, dtype=torch.uint8)
                buffer = self._buffers[index] = _Buffer(data, self.endpoint.register_tensor(data))
            self._next = 1 - index
            buffer.manifest = None
            self.generation += 1
            generation = buffer.generation = self.generation
        header = _header(buffer.data)
        header[0], header[1] = WRITING, generation  # a reader of the old version sees it is gone
        body = buffer.data[HEADER_BYTES:]
        pack(layout, body, items)
        sums = checksums(layout, body)
        header[0] = version
        manifest = TensorManifest(layout.tensors, layout.total_bytes, version, buffer.region.addr + HEADER_BYTES,
                                  buffer.region.addr, layout.chunk_bytes, sums)
        with self._lock:
            buffer.manifest = manifest
        return manifest

    @property
    def versions(self) -> list[int]:
        """Versions held now (at most two), oldest first."""
        with self._lock:
            return sorted(b.manifest.version for b in self._buffers if b.manifest is not None)

    def manifest(self, version: int | None = None) -> TensorManifest:
        """The manifest of ``version`` (None: the latest); a version no longer held is refused."""
        with self._lock:  # oldest generation first, so a version published twice maps to its latest copy
            ordered = sorted((b for b in self._buffers if b.manifest is not None), key=lambda b: b.generation)
            held = {b.manifest.version: b.manifest for b in ordered if b.manifest is not None}
        if not held:
            raise TransferError("no weights are published yet")
        if version is None:
            return held[max(held)]
        if version not in held:
            raise TransferError(f"weights version {version} is not held by the publisher (it holds "
                                f"{sorted(held)}): pull the latest")
        return held[version]

    def close(self) -> None:
        with self._lock:
            buffers, self._buffers = self._buffers, []
        for b in buffers:
            self.endpoint.unregister(b.region)


@dataclass(frozen=True)
class PullStats:
    bytes: int
    seconds: float

    @property
    def mbps(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


def pull_weights(endpoint: TransferEndpoint, peer_session: str, manifest: bytes | str | TensorManifest,
                 *, stats: list[PullStats] | None = None, verify: bool = True) -> dict[str, torch.Tensor]:
    """Read a published version from ``peer_session`` into a fresh local buffer; name -> tensor views.

    The publisher buffer's header must name the manifest's version before and after the data is read (else
    the version was replaced: refused), and every chunk must match its checksum (else the read is torn).
    A replica that pulls every step should keep a ``WeightsPuller`` instead (no allocation, registration
    or page faults per pull: a fresh 256 MiB buffer doubles the read time). ``verify=False`` skips the
    checksums (the header check stays: it is what catches the publisher moving on)."""
    m = manifest if isinstance(manifest, TensorManifest) else TensorManifest.from_json(manifest)
    data = torch.empty(HEADER_BYTES + m.total_bytes, dtype=torch.uint8)
    region = endpoint.register_tensor(data)
    try:
        return _pull_into(endpoint, peer_session, m, data, stats, verify)
    finally:
        endpoint.unregister(region)


class WeightsPuller:
    """A registered receive buffer kept across pulls, for a replica or engine that pulls every version.

    The views ``pull`` returns stay valid until the next ``pull`` (the caller copies them into its model).
    The buffer grows when a layout needs more and is touched once when made, so no pull page-faults."""

    def __init__(self, endpoint: TransferEndpoint) -> None:
        self.endpoint = endpoint
        self._data: torch.Tensor | None = None
        self._region: Region | None = None
        self._lock = threading.Lock()

    def pull(self, peer_session: str, manifest: bytes | str | TensorManifest, *,
             stats: list[PullStats] | None = None, verify: bool = True) -> dict[str, torch.Tensor]:
        m = manifest if isinstance(manifest, TensorManifest) else TensorManifest.from_json(manifest)
        with self._lock:
            need = HEADER_BYTES + m.total_bytes
            if self._data is None or self._data.numel() < need:
                self._release()
                self._data = torch.empty(need, dtype=torch.uint8)
                self._data.fill_(0)  # fault the pages in now, not during the transfer
                self._region = self.endpoint.register_tensor(self._data)
            return _pull_into(self.endpoint, peer_session, m, self._data, stats, verify)

    def _release(self) -> None:
        if self._region is not None:
            self.endpoint.unregister(self._region)
        self._data = self._region = None

    def close(self) -> None:
        with self._lock:
            self._release()


def _pull_into(endpoint: TransferEndpoint, peer_session: str, m: TensorManifest, data: torch.Tensor,
               stats: list[PullStats] | None, verify: bool = True) -> dict[str, torch.Tensor]:
    """The pull itself, into ``data`` (registered, header + ``m.total_bytes`` at least)."""
    if not m.addr or not m.header_addr or not m.checksums:
        raise TransferError(f"the manifest of version {m.version} was never published (no address or checksums)")
    body = data[HEADER_BYTES:HEADER_BYTES + m.total_bytes]
    raw = memoryview(body.numpy())
    started = time.perf_counter()
    head = Span(data.data_ptr(), 16)
    remote_head = Span(m.header_addr, 16)
    endpoint.read(peer_session, [head], [remote_head])
    _check_header(data, m, "before the read")
    base = data.data_ptr() + HEADER_BYTES
    chunks = m.chunks()
    # Each chunk's checksum runs on a worker while the next chunks are read (crc32c releases the GIL), so
    # verifying costs little on top of the transfer.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-pull-crc") as pool:
        sums = []
        for i in range(0, len(chunks), READ_GROUP):
            group = chunks[i:i + READ_GROUP]
            endpoint.read(peer_session, [Span(base + o, n) for o, n in group], [Span(m.addr + o, n) for o, n in group])
            if verify:
                sums += [pool.submit(crc32c.crc32c, raw[o:o + n]) for o, n in group]
        endpoint.read(peer_session, [head], [remote_head])
        _check_header(data, m, "after the read")
        got = [f.result() for f in sums]
    bad = [i for i, (a, b) in enumerate(zip(got, m.checksums, strict=True)) if a != b] if verify else []
    if bad:
        raise TransferError(f"weights version {m.version} from {peer_session}: chunk(s) {bad[:5]} of "
                            f"{len(got)} fail their checksum (a torn or corrupted read)")
    if stats is not None:
        stats.append(PullStats(m.total_bytes, time.perf_counter() - started))
    return m.views(body)


def _check_header(data: torch.Tensor, m: TensorManifest, when: str) -> None:
    held = int(_header(data)[0])
    if held != m.version:
        state = "being overwritten" if held == WRITING else f"holding version {held}"
        raise TransferError(f"weights version {m.version} is no longer held by the publisher ({when}: the buffer is "
                            f"{state}): pull the latest")


# -- gradients: satellites write into per-satellite slots, the core sums -------------------------------------


@dataclass(frozen=True)
class SlotDescriptor:
    """Where one satellite writes its gradients: ``numel`` fp32 values at ``addr`` on ``session``."""

    slot_id: str
    session: str
    addr: int
    numel: int
    sizes: tuple[int, ...]
    """numel of each gradient buffer, in ``gradient_buffers()`` order (checked by the writer)."""

    def to_json(self) -> bytes:
        return json.dumps({"slot_id": self.slot_id, "session": self.session, "addr": self.addr, "numel": self.numel,
                           "sizes": list(self.sizes)}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> SlotDescriptor:
        try:
            raw = json.loads(data)
            return cls(str(raw["slot_id"]), str(raw["session"]), int(raw["addr"]), int(raw["numel"]),
                       tuple(int(s) for s in raw["sizes"]))
        except (ValueError, KeyError, TypeError) as e:
            raise TransferError(f"not a gradient slot descriptor: {e}") from e


@dataclass
class _Slot:
    data: torch.Tensor
    region: Region
    descriptor: SlotDescriptor = field(repr=False)


class GradientSlots:
    """One registered flat fp32 slot per satellite on the core; the core sums the slots that reported.

    Why slots, not a reduce: a collective needs every member present at every step, so a satellite could
    neither join a running step nor die without hanging the others. A slot is written one-sidedly by its
    satellite; the core adds it only once the satellite said (Trainer.Gradients) that the write completed.
    Thread-safe."""

    def __init__(self, endpoint: TransferEndpoint, sizes: Sequence[int]) -> None:
        if not sizes or any(s <= 0 for s in sizes):
            raise TransferError(f"gradient slots need positive buffer sizes, got {list(sizes)[:5]}")
        self.endpoint = endpoint
        self.sizes = tuple(int(s) for s in sizes)
        self.numel = sum(self.sizes)
        self._slots: dict[str, _Slot] = {}
        self._retired: list[torch.Tensor] = []
        self._dying: list[torch.Tensor] = []
        """Memory of freed slots, kept until ``reap``: a write a satellite started before its slot was freed
        may still be landing (Mooncake checks registration before it copies, not after)."""
        self._lock = threading.Lock()

    @classmethod
    def for_buffers(cls, endpoint: TransferEndpoint, grad_buffers: Sequence[torch.Tensor]) -> GradientSlots:
        return cls(endpoint, [g.numel() for g in grad_buffers])

    def allocate(self, slot_id: str) -> SlotDescriptor:
        """The slot of ``slot_id`` (a satellite's cell id), allocated and registered on first use."""
        with self._lock:
            known = self._slots.get(slot_id)
            if known is not None:
                return known.descriptor
            data = torch.zeros(self.numel, dtype=torch.float32)
            region = self.endpoint.register_tensor(data)
            descriptor = SlotDescriptor(slot_id, self.endpoint.session_id, region.addr, self.numel, self.sizes)
            self._slots[slot_id] = _Slot(data, region, descriptor)
            return descriptor

    def free(self, slot_id: str) -> None:
        """Unregister the slot (a satellite that left); its memory lives until ``reap``. Unknown ids are ignored."""
        with self._lock:
            slot = self._slots.pop(slot_id, None)
            if slot is not None:
                self._retired.append(slot.data)
        if slot is not None:
            self.endpoint.unregister(slot.region)

    def reap(self) -> None:
        """Called once per step: memory freed before the previous call is dropped (a whole step after its slot
        was unregistered, long after any write could still land); what was freed since waits one more step."""
        with self._lock:
            self._dying, self._retired = self._retired, []

    def __contains__(self, slot_id: str) -> bool:
        with self._lock:
            return slot_id in self._slots

    def slot(self, slot_id: str) -> torch.Tensor:
        with self._lock:
            known = self._slots.get(slot_id)
        if known is None:
            raise TransferError(f"no gradient slot for {slot_id!r}")
        return known.data

    def sum_into(self, grad_buffers: Sequence[torch.Tensor], slot_ids: Iterable[str]) -> None:
        """Add each named slot to ``grad_buffers`` (in place, in their order), buffer by buffer."""
        for slot_id in slot_ids:
            self.sum_flat_into(grad_buffers, self.slot(slot_id))

    def sum_flat_into(self, grad_buffers: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        """Add one flat fp32 vector of this layout to ``grad_buffers`` (in place)."""
        if [g.numel() for g in grad_buffers] != list(self.sizes) or flat.numel() != self.numel:
            raise TransferError("the gradient buffers do not match the slots' layout")
        offset = 0
        with torch.no_grad():
            for g in grad_buffers:
                n = g.numel()
                g.add_(flat[offset:offset + n].view(g.shape).to(g.dtype))
                offset += n

    def close(self) -> None:
        with self._lock:
            slots, self._slots, self._retired, self._dying = list(self._slots.values()), {}, [], []
        for s in slots:
            self.endpoint.unregister(s.region)


def flatten_gradients(grads: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The gradients as one fp32 vector (``out`` reused when given)."""
    numel = sum(g.numel() for g in grads)
    flat = out if out is not None else torch.empty(numel, dtype=torch.float32)
    if flat.numel() != numel:
        raise TransferError(f"a flat buffer of {flat.numel()} values cannot hold {numel} gradient values")
    offset = 0
    with torch.no_grad():
        for g in grads:
            flat[offset:offset + g.numel()].copy_(g.detach().reshape(-1))
            offset += g.numel()
    return flat


def write_gradients(endpoint: TransferEndpoint, peer_session: str, slot: SlotDescriptor | bytes | str,
                    grads: Sequence[torch.Tensor]) -> int:
    """Write ``grads`` (fp32, flattened in order) into the core's ``slot``; returns the bytes written.

    Blocking; when it returns the bytes are in the core's memory (Mooncake's sync write), so the caller may
    then tell the core (Trainer.Gradients)."""
    d = slot if isinstance(slot, SlotDescriptor) else SlotDescriptor.from_json(slot)
    sizes = tuple(g.numel() for g in grads)
    if sizes != d.sizes:
        raise TransferError(f"gradients of {len(sizes)} buffers ({sum(sizes)} values) do not fit slot "
                            f"{d.slot_id!r} ({len(d.sizes)} buffers, {d.numel} values): another model?")
    flat = flatten_gradients(grads)
    region = endpoint.register_tensor(flat)
    try:
        nbytes = flat.numel() * 4
        base = flat.data_ptr()
        local = [Span(base + o, min(CHUNK_BYTES, nbytes - o)) for o in range(0, nbytes, CHUNK_BYTES)]
        remote = [Span(d.addr + s.addr - base, s.length) for s in local]
        endpoint.write(peer_session, local, remote)
    finally:
        endpoint.unregister(region)
    return nbytes
