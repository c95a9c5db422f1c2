"""A satellite trainer replica: a cell lent to training joins the core's running step over gRPC + Mooncake.

``join(trainer_endpoint)`` calls Trainer.Join (the core allocates a gradient slot and names the weights the
open step trains from), pulls those weights over Mooncake into its backend, and starts the work loop on a
thread; it returns at once with the measured parts, so a cell stays responsive to its controller. The loop:

    Claim -> forward_backward (gradients accumulate) -> Finish      until the core answers "done"
    write the accumulated gradients into the core's slot (Mooncake) -> Gradients
    Claim again: "wait" between steps; "weights" when the next step trains from a new version (pull it,
    drop the old gradients); "released" when the core gave its micro-steps away (drop them, Join again)

A heartbeat thread renews the lease while a long micro-step runs. ``leave(reason)`` stops the loop at a
micro-step boundary, lands what it finished (so the work is kept), then calls Trainer.Leave.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import grpc

from gyre.cluster.auth import metadata
from gyre.cluster.proto import gyre_pb2, gyre_pb2_grpc
from gyre.cluster.tls import TlsSection, channel
from gyre.cluster.trainer_service import MESSAGE_OPTIONS
from gyre.errors import TransferError
from gyre.trainer.errors import TrainerError
from gyre.trainer.hub import result_to_json
from gyre.transfer.tensors import PullStats, SlotDescriptor, WeightsPuller, write_gradients

if TYPE_CHECKING:
    from gyre.trainer.torch_backend import TorchBackend
    from gyre.transfer.endpoint import TransferEndpoint

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 60.0


class SatelliteError(TrainerError):
    """The satellite could not do what it was asked (the core refused, or it is not running)."""


class SatelliteReplica:
    """One cell's trainer replica while it is lent to training (see the module docstring)."""

    def __init__(self, *, cell_id: str, backend: TorchBackend, endpoint: TransferEndpoint, secret: str,
                 on_claim: Callable[[int, int], None] | None = None, tls: TlsSection | None = None) -> None:
        """``on_claim(step, micro_step)`` runs after each claim, before the work (tests order events with it)."""
        self.cell_id, self.backend, self.endpoint = cell_id, backend, endpoint
        self._metadata = metadata(secret)
        self.on_claim = on_claim
        self.tls = tls
        self._puller = WeightsPuller(endpoint)  # one registered buffer for every version it pulls
        self._channel: grpc.Channel | None = None
        self._stub: gyre_pb2_grpc.TrainerStub | None = None
        self._slot: SlotDescriptor | None = None
        self._peer = ""
        self.lease_s = 30.0
        self.version = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._heart: threading.Thread | None = None
        self.error: BaseException | None = None
        self.micro_steps: list[tuple[int, int]] = []
        """``(step, micro_step)`` of every micro-step this replica finished (reported or not)."""
        self.pulls: list[PullStats] = []
        self._step: int | None = None
        self._finished: list[int] = []
        self._reported: list[int] = []

    # -- membership -----------------------------------------------------------------------------------------

    def join(self, trainer_endpoint: str, weights: gyre_pb2.WeightsRef | None = None) -> Mapping[str, float]:
        """Join the core at ``trainer_endpoint`` and start working; returns the join's measured parts.

        ``weights`` (the controller's JoinStep.weights) is pulled *before* joining, so the satellite arrives
        ready to claim and ``satellite_joined`` records the transfer; the core's answer names the version
        the open step trains from, pulled too if it differs."""
        if self._thread is not None and self._thread.is_alive():
            return {"weights_bytes": 0.0, "weights_pull_s": 0.0}
        self._channel = channel(trainer_endpoint, self.tls, MESSAGE_OPTIONS)
        self._stub = gyre_pb2_grpc.TrainerStub(self._channel)
        self._stop.clear()
        self.error = None
        pre = self._pull(weights) if weights is not None and weights.manifest else PullStats(0, 0.0)
        started = time.perf_counter()
        joined = self._join(transfer_s=pre.seconds)
        rpc_s = time.perf_counter() - started
        pulled = self._pull(joined.weights)
        self._thread = threading.Thread(target=self._guarded, name=f"gyre-satellite-{self.cell_id}", daemon=True)
        self._thread.start()
        self._heart = threading.Thread(target=self._heartbeats, name=f"gyre-satellite-hb-{self.cell_id}",
                                       daemon=True)
        self._heart.start()
        return {"join_rpc_s": rpc_s, "weights_bytes": float(pre.bytes + pulled.bytes),
                "weights_pull_s": pre.seconds + pulled.seconds}

    def _join(self, transfer_s: float = 0.0) -> gyre_pb2.TrainerJoined:
        assert self._stub is not None
        joined = self._stub.Join(gyre_pb2.TrainerJoin(cell_id=self.cell_id, transfer_session=self.endpoint.session_id,
                                                      transfer_s=transfer_s),
                                 metadata=self._metadata, timeout=RPC_TIMEOUT_S)
        self._slot = SlotDescriptor.from_json(joined.gradient_slot)
        self._peer = joined.weights.peer_session
        self.lease_s = joined.lease_s or self.lease_s
        self._drop()
        return joined

    def _pull(self, ref: gyre_pb2.WeightsRef) -> PullStats:
        if ref.version == self.version:
            return PullStats(0, 0.0)
        if not ref.peer_session or not ref.manifest:
            raise SatelliteError(f"the core offered weights v{ref.version} without a Mooncake manifest")
        stats: list[PullStats] = []
        tensors = self._puller.pull(ref.peer_session, ref.manifest, stats=stats)
        self.backend.load_weights(tensors, policy_version=ref.version)  # copies out of the puller's buffer
        self.version = ref.version
        self.pulls += stats
        return stats[0]

    def leave(self, reason: str = "") -> None:
        """Stop at a micro-step boundary, land finished work, tell the core; the replica can join again."""
        self._stop.set()
        for thread in (self._thread, self._heart):
            if thread is not None:
                thread.join(RPC_TIMEOUT_S * 2)
        self._thread = self._heart = None
        if self._stub is not None:
            try:
                self._stub.Leave(gyre_pb2.TrainerLeave(cell_id=self.cell_id, reason=reason), metadata=self._metadata,
                                 timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as e:  # the core is gone: there is nobody to tell
                log.warning("satellite %s: Leave failed: %s", self.cell_id, e)
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None
        self._puller.close()  # re-registered on the next join's pull
        if self.error is not None:
            raise SatelliteError(f"satellite {self.cell_id} failed: {self.error}") from self.error

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the loop -------------------------------------------------------------------------------------------

    def _guarded(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # kept for leave(); the core's lease releases what it held
            self.error = e
            self._stop.set()  # no more heartbeats: a replica that cannot work must not keep its lease
            log.exception("satellite %s stopped", self.cell_id)

    def _drop(self) -> None:
        """Forget the gradients of the step in progress (a new step, or the core released them)."""
        self.backend.zero_grad()
        self._step, self._finished, self._reported = None, [], []

    def _loop(self) -> None:
        from gyre.trainer.batch import TrainBatch

        stub = self._stub
        assert stub is not None
        while not self._stop.is_set():
            reply = stub.Claim(gyre_pb2.ClaimRequest(cell_id=self.cell_id, policy_version=self.version),
                               metadata=self._metadata, timeout=RPC_TIMEOUT_S)
            if reply.status == "claimed":
                if reply.step != self._step:
                    self._drop()
                    self._step = reply.step
                if self.on_claim is not None:
                    self.on_claim(reply.step, reply.micro_step)
                result = self.backend.forward_backward(TrainBatch.from_bytes(reply.batch))
                ack = stub.Finish(gyre_pb2.MicroStepDone(cell_id=self.cell_id, step=reply.step,
                                                         micro_step=reply.micro_step, result=result_to_json(result)),
                                  metadata=self._metadata, timeout=RPC_TIMEOUT_S)
                if not ack.ok:
                    log.warning("satellite %s: Finish refused (%s); dropping the step", self.cell_id, ack.error)
                    self._drop()
                    continue
                self._finished.append(reply.micro_step)
                self.micro_steps.append((reply.step, reply.micro_step))
            elif reply.status == "weights":
                self._drop()
                self._pull(reply.weights)
            elif reply.status == "released":
                log.warning("satellite %s: the core released its micro-steps; joining again", self.cell_id)
                self._join()
            elif reply.status in ("done", "wait"):
                self._land()
            else:
                raise SatelliteError(f"the core answered Claim with unknown status {reply.status!r}")
        self._land()

    def _land(self) -> None:
        """Write the accumulated gradients into the core's slot and report them (if there is anything new)."""
        if not self._finished or self._finished == self._reported or self._step is None:
            return
        assert self._stub is not None and self._slot is not None
        try:
            write_gradients(self.endpoint, self._slot.session, self._slot, self.backend.gradient_buffers())
        except TransferError as e:  # the slot is gone (released): the next Claim says so
            log.warning("satellite %s: writing gradients failed: %s", self.cell_id, e)
            return
        ack = self._stub.Gradients(gyre_pb2.GradientsWritten(cell_id=self.cell_id, step=self._step,
                                                             micro_steps=self._finished),
                                   metadata=self._metadata, timeout=RPC_TIMEOUT_S)
        if ack.ok:
            self._reported = list(self._finished)
        else:
            log.warning("satellite %s: Gradients refused (%s)", self.cell_id, ack.error)
            self._drop()

    def _heartbeats(self) -> None:
        while not self._stop.wait(max(0.05, self.lease_s / 5)):
            stub, loop = self._stub, self._thread
            if stub is None or loop is None or not loop.is_alive():
                return
            try:
                stub.Heartbeat(gyre_pb2.TrainerHeartbeat(cell_id=self.cell_id), metadata=self._metadata,
                               timeout=max(1.0, self.lease_s))
            except grpc.RpcError as e:
                log.debug("satellite %s: heartbeat failed: %s", self.cell_id, e)
