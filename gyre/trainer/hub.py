"""The core's side of satellites, without gRPC: members, leases, the open step's batches, weights and gradients.

``TrainerHub`` is what the Trainer service (`gyre.cluster.trainer_service`, the gRPC layer over it) and the
core's training loop share — the step coordinator (the one writer of training events), the open step's
micro-batches (serialized once, as safetensors), the weights publisher and the per-satellite gradient slots
(``gyre.transfer.tensors``, Mooncake), the members and their leases. The core's loop calls ``run_step``: its
own replica works, then it waits until every micro-step is finished *and* every satellite that finished some
has landed its gradients in its slot, and adds those slots to its own gradients before the optimizer step.

Leases, never a hang: every call of a satellite (and its heartbeats) renews its lease. A satellite silent for
``lease_s``, one the controller reports lost (``release_cell``), or one that leaves with work in flight has
every micro-step it holds in the open step released (``micro_step_released`` events, its results dropped from
the coordinator's summary, its slot not summed): they become claimable again and the core redoes them. A
satellite that leaves with everything landed keeps its contribution: its slot is folded into the hub's
accumulator before the slot is freed. A released satellite that is in fact alive is told ``released`` and
joins again with empty gradients, so nothing is ever counted twice.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from gyre.trainer.claims import open_step
from gyre.trainer.errors import StepProtocolError
from gyre.trainer.loss import LossStats
from gyre.trainer.protocol import MicroStepResult
from gyre.trainer.replica import Coordinator, work
from gyre.transfer.tensors import GradientSlots, SlotDescriptor, TensorManifest, WeightsPublisher

if TYPE_CHECKING:
    import torch

    from gyre.trainer.batch import TrainBatch
    from gyre.trainer.coordinator import StepCoordinator
    from gyre.trainer.protocol import TrainerBackend
    from gyre.transfer.endpoint import TransferEndpoint

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
CLAIM_POLL_S = 0.5
"""How long a Claim that has nothing to give waits on the core for a change before answering (a long poll)."""


def result_to_json(result: MicroStepResult) -> bytes:
    return json.dumps(asdict(result), separators=(",", ":")).encode()


def result_from_json(data: bytes) -> MicroStepResult:
    try:
        raw = json.loads(data)
        raw["stats"] = LossStats(**raw["stats"])
        return MicroStepResult(**raw)
    except (ValueError, KeyError, TypeError) as e:
        raise StepProtocolError(f"not a micro-step result: {e}") from e


@dataclass
class Member:
    """A joined satellite, as the core sees it."""

    cell_id: str
    session: str
    slot: SlotDescriptor
    seen: float
    step: int | None = None
    """The step whose micro-steps its gradients hold."""
    finished: set[int] = field(default_factory=set)
    landed: set[int] = field(default_factory=set)
    """Micro-steps of ``step`` whose gradients its last report put in its slot."""


@dataclass(frozen=True)
class Joined:
    step: int
    manifest: TensorManifest
    slot: SlotDescriptor
    lease_s: float


@dataclass(frozen=True)
class Granted:
    """A Claim's answer: ``status`` as the proto's ClaimReply."""

    status: str
    step: int = -1
    micro_step: int = -1
    batch: bytes = b""
    manifest: TensorManifest | None = None


@dataclass(frozen=True)
class FileRef:
    """Where a published version's file lies and its checksum (empty: no file, pull it over Mooncake)."""

    location: str = ""
    sha256: str = ""


class TrainerHub:
    """The core's side of satellites: members, leases, the open step's batches, weights and gradient slots.

    Thread-safe. Lock order: the hub's lock, then the coordinator's (the coordinator never calls back)."""

    def __init__(self, coordinator: StepCoordinator, endpoint: TransferEndpoint, *, core_cell: str,
                 gradient_sizes: Sequence[int], lease_s: float = DEFAULT_LEASE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.coordinator, self.endpoint, self.core_cell = coordinator, endpoint, core_cell
        self.lease_s, self.clock = lease_s, clock
        self.publisher = WeightsPublisher(endpoint)
        self.slots = GradientSlots(endpoint, gradient_sizes)
        self._files: dict[int, FileRef] = {}
        self._lock = threading.RLock()
        self._members: dict[str, Member] = {}
        self._step: int | None = None
        self._batches: dict[int, bytes] = {}
        """The open step's micro-batches offered so far (a streamed step's grow as its groups complete)."""
        self._closing = False
        self._absorbed: torch.Tensor | None = None
        """Gradients of satellites that left with everything landed during the open step (flat fp32)."""
        self._absorbed_steps: set[int] = set()
        self._free_after_close: list[str] = []
        self.yield_to_satellites = False
        """Fault injection (`gyre.cluster.faults`, point ``yield``): the core claims a step's micro-steps only
        once each satellite joined at its start has claimed one or left."""

    # -- weights ----------------------------------------------------------------------------------------------

    def publish(self, version: int, named: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]], *,
                location: str = "", sha256: str = "") -> TensorManifest:
        """Make ``version`` pullable over Mooncake (the file, where there is one, is named in WeightsRefs)."""
        manifest = self.publisher.publish(version, named)
        self._files[version] = FileRef(location, sha256)
        for old in [v for v in self._files if v not in self.publisher.versions]:
            del self._files[old]
        return manifest

    def file_ref(self, version: int) -> FileRef:
        """The durable file of a published ``version``, where there is one (a WeightsRef names it)."""
        return self._files.get(version, FileRef())

    # -- the core's loop --------------------------------------------------------------------------------------

    def open_step(self, step: int, batches: Sequence[TrainBatch], backend: TrainerBackend) -> None:
        """Offer ``batches`` (the step the coordinator just opened) to satellites; the weights the step trains
        from are published first if they are not yet (the first step, a resume)."""
        version = self.coordinator.state.policy_version
        if version not in self.publisher.versions:
            self.publish(version, list(backend.named_tensors()))
        with self._lock:
            self._step, self._batches, self._closing, self._absorbed = step, {}, False, None
            self._absorbed_steps = set()
        self.offer(batches)

    def offer(self, batches: Sequence[TrainBatch]) -> None:
        """More micro-batches of the open step (by their index), before the coordinator marks them ready."""
        data = {b.index: b.to_bytes() for b in batches}
        with self._lock:
            self._batches.update(data)

    def run_step(self, backend: TrainerBackend, batch_of: Callable[[int], TrainBatch], *,
                 coordinator: Coordinator | None = None, timeout_s: float = 600.0) -> list[MicroStepResult]:
        """The core's replica works until nothing is left, then waits for the step to be complete (leases
        expiring meanwhile hand micro-steps back to it), then sums the satellites' slots into its gradients.
        ``coordinator``: what the core's replica claims through (a streamed step's feed; default the hub's)."""
        deadline = time.monotonic() + timeout_s
        if self.yield_to_satellites:
            self._let_satellites_claim(deadline)
        done: list[MicroStepResult] = []
        while True:
            done += work(backend, coordinator or self.coordinator, self.core_cell, batch_of,
                         timeout_s=max(1.0, deadline - time.monotonic()))
            if self.collect(backend.gradient_buffers()):
                return done
            if time.monotonic() > deadline:
                raise StepProtocolError(f"step {self._step} was not complete within {timeout_s} s: "
                                        f"{self.describe_pending()}")
            self.expire_leases()
            self.coordinator.wait_for_work(0.1)

    def _let_satellites_claim(self, deadline: float) -> None:
        with self._lock:
            waiting = set(self._members)
        while waiting and time.monotonic() < deadline:
            self.expire_leases()
            with self._lock:
                waiting = {c for c in waiting if c in self._members and self._members[c].step != self._step}
                step = open_step(self.coordinator.state)
                if step is None or len(step.claimed) >= step.planned_micro_steps:
                    return  # nothing left for them to claim
            if waiting:  # outside the hub's lock: the satellites' claims take it
                self.coordinator.wait_for_work(0.05)

    def complete(self) -> bool:
        """Every micro-step finished, and each one a satellite finished is in that satellite's landed slot."""
        with self._lock:
            step = open_step(self.coordinator.state)
            if step is None or step.step != self._step or step.pending:
                return False
            for m, cell in step.claimed.items():
                if cell == self.core_cell or m in self._absorbed_steps:
                    continue
                member = self._members.get(cell)
                if member is None or member.step != step.step or m not in member.landed:
                    return False
            return True

    def collect(self, grad_buffers: Sequence[torch.Tensor]) -> bool:
        """If the step is complete: add the landed slots (and what departed satellites left) into
        ``grad_buffers`` and freeze the step (no release touches it any more); else False."""
        with self._lock:
            if not self.complete():
                return False
            self._closing = True
            ids = [c for c, m in self._members.items() if m.step == self._step and m.landed]
            self.slots.sum_into(grad_buffers, ids)
            if self._absorbed is not None:
                self.slots.sum_flat_into(grad_buffers, self._absorbed)
            return True

    def close_step(self) -> None:
        """The optimizer step is applied: the step's batches and contributions are dropped."""
        with self._lock:
            self._step, self._batches, self._closing, self._absorbed = None, {}, False, None
            self._absorbed_steps = set()
            for member in self._members.values():
                member.step, member.finished, member.landed = None, set(), set()
            self.slots.reap()  # memory of slots freed a step ago goes; this step's frees wait one more
            for cell in self._free_after_close:
                self.slots.free(cell)
            self._free_after_close = []

    def describe_pending(self) -> str:
        with self._lock:
            step = open_step(self.coordinator.state)
            if step is None:
                return "no step is open"
            waiting = {m: step.claimed.get(m, "nobody") for m in step.pending}
            unlanded = {c: sorted(m.finished - m.landed) for c, m in self._members.items() if m.finished - m.landed}
            return f"unfinished micro-steps (holder) {waiting}, finished without landed gradients {unlanded}"

    # -- leases -----------------------------------------------------------------------------------------------

    def expire_leases(self) -> list[str]:
        """Release every satellite silent for longer than its lease; returns their cell ids."""
        now = self.clock()
        with self._lock:
            late = [c for c, m in self._members.items() if now - m.seen > self.lease_s]
        for cell in late:
            self.release_cell(cell, f"lease expired ({self.lease_s:g} s without a call)")
        return late

    def release_cell(self, cell_id: str, reason: str) -> list[int]:
        """Drop ``cell_id`` at once (dead, lost, or its lease ran out): every micro-step it holds in the open
        step is released and its slot is not summed (a write may have been cut off half-way). Returns the
        released micro-steps."""
        with self._lock:
            member = self._members.pop(cell_id, None)
            if member is None:
                return []
            released: list[int] = []
            if self._closing and member.step == self._step:
                self._free_after_close.append(cell_id)  # its landed gradients are being summed: keep them
            else:
                released = self.coordinator.release(cell_id, self.coordinator.held_by(cell_id), reason)
                self.slots.free(cell_id)
            self.coordinator.leave(cell_id, reason)
        log.warning("trainer: released satellite %s (%s): micro-steps %s", cell_id, reason, released)
        return released

    # -- the service's calls ----------------------------------------------------------------------------------

    def join(self, cell_id: str, session: str, transfer_s: float = 0.0) -> Joined:
        if not cell_id or cell_id == self.core_cell:
            raise StepProtocolError(f"cell id {cell_id!r} cannot join as a satellite")
        with self._lock:
            if cell_id in self._members:  # a restarted satellite: whatever the old one held is gone
                self.release_cell(cell_id, "joined again")
            state = self.coordinator.state
            step = open_step(state)
            version = step.policy_version if step is not None else state.policy_version
            manifest = self.publisher.manifest(version if step is not None else None)
            descriptor = self.slots.allocate(cell_id)
            self._members[cell_id] = Member(cell_id, session, descriptor, self.clock())
            self.coordinator.join(cell_id, transfer_s=max(0.0, transfer_s))
            return Joined(step.step if step is not None else -1, manifest, descriptor, self.lease_s)

    def _member(self, cell_id: str) -> Member | None:
        member = self._members.get(cell_id)
        if member is not None:
            member.seen = self.clock()
        return member

    def heartbeat(self, cell_id: str) -> bool:
        with self._lock:
            return self._member(cell_id) is not None

    def claim(self, cell_id: str, policy_version: int, *, wait_s: float = CLAIM_POLL_S) -> Granted:
        """A micro-step for ``cell_id``, or why not; waits up to ``wait_s`` for a change when there is none."""
        deadline = time.monotonic() + wait_s
        self.expire_leases()  # a live satellite may take over a dead one's micro-steps while the core is busy
        while True:
            granted = self._claim_once(cell_id, policy_version)
            if granted.status in ("claimed", "weights", "released") or time.monotonic() >= deadline:
                return granted
            if granted.status == "done":
                with self._lock:
                    member = self._members.get(cell_id)
                    if member is not None and member.finished - member.landed:
                        return granted  # it has gradients to write: answer now
            self.coordinator.wait_for_work(min(0.1, max(0.0, deadline - time.monotonic())))

    def _claim_once(self, cell_id: str, policy_version: int) -> Granted:
        with self._lock:
            member = self._member(cell_id)
            if member is None:
                return Granted("released")
            step = open_step(self.coordinator.state)
            if step is None or step.step != self._step or self._closing:
                return Granted("wait")
            if step.policy_version != policy_version:
                return Granted("weights", step.step, manifest=self.publisher.manifest(step.policy_version))
            if member.step not in (None, step.step):
                member.finished, member.landed = set(), set()
            claim = self.coordinator.claim(cell_id)
            if claim.status != "claimed":
                return Granted(claim.status, step.step)
            assert claim.step is not None and claim.micro_step is not None
            member.step = claim.step
            return Granted("claimed", claim.step, claim.micro_step, self._batches[claim.micro_step])

    def finish(self, cell_id: str, step: int, micro_step: int, result: MicroStepResult) -> None:
        with self._lock:
            member = self._member(cell_id)
            if member is None:
                raise StepProtocolError(f"{cell_id} was released (or never joined): join again")
            self.coordinator.finish(cell_id, step, micro_step, result)
            member.finished.add(micro_step)

    def gradients(self, cell_id: str, step: int, micro_steps: Sequence[int]) -> None:
        """``cell_id``'s slot now holds the sum of its gradients of ``micro_steps`` (all it finished)."""
        with self._lock:
            member = self._member(cell_id)
            if member is None:
                raise StepProtocolError(f"{cell_id} was released (or never joined): its gradients are dropped")
            if member.step != step or self._step != step:
                raise StepProtocolError(f"{cell_id} reported gradients of step {step}, but the open step is "
                                        f"{self._step} and it works on {member.step}")
            if set(micro_steps) != member.finished:
                raise StepProtocolError(f"{cell_id} reported gradients of micro-steps {sorted(micro_steps)}, but it "
                                        f"finished {sorted(member.finished)} of step {step}")
            member.landed = set(micro_steps)
        self.coordinator.notify()  # the core may be waiting for exactly this

    def leave(self, cell_id: str, reason: str) -> None:
        """A satellite leaving on purpose (its loop stopped, no write in flight): landed gradients are kept
        (folded into the hub's accumulator, or summed by a closing step), anything unlanded is released."""
        with self._lock:
            member = self._members.get(cell_id)
            if member is None:
                return
            held = set(self.coordinator.held_by(cell_id)) if member.step == self._step else set()
            if held and not held <= member.landed:
                self.release_cell(cell_id, reason or "left with micro-steps in flight")
                return
            self._members.pop(cell_id)
            if held and self._closing:
                self._free_after_close.append(cell_id)  # being summed right now
            elif held:
                flat = self.slots.slot(cell_id)
                self._absorbed = flat.clone() if self._absorbed is None else self._absorbed.add_(flat)
                self._absorbed_steps |= held  # they stay finished by it; complete() counts them
                self.slots.free(cell_id)
            else:
                self.slots.free(cell_id)
            self.coordinator.leave(cell_id, reason)
        self.coordinator.notify()

    def close(self) -> None:
        self.publisher.close()
        self.slots.close()
