"""The core's Trainer service: ``gyre.v1.Trainer`` over gRPC in front of a `gyre.trainer.hub.TrainerHub`.

Satellites join a running step, claim micro-steps and land their gradients through it; what those calls do
(members, leases, the open step, weights and gradient slots) is the hub's, which knows nothing of gRPC.
``TrainerServer`` runs the service (``grpc.aio`` on its own event-loop thread, the run secret checked on
every call); blocking hub calls run on a thread pool, never on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc

from gyre.cluster.address import bracket
from gyre.cluster.auth import SecretInterceptor
from gyre.cluster.proto import gyre_pb2, gyre_pb2_grpc
from gyre.cluster.tls import TlsSection, add_port
from gyre.errors import TransferError
from gyre.trainer.errors import StepProtocolError
from gyre.trainer.hub import DEFAULT_LEASE_S, Granted, Joined, TrainerHub, result_from_json

if TYPE_CHECKING:
    from gyre.trainer.coordinator import StepCoordinator
    from gyre.trainer.protocol import TrainerBackend
    from gyre.transfer.endpoint import TransferEndpoint
    from gyre.transfer.tensors import TensorManifest

MESSAGE_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
"""A claimed micro-batch travels in the ClaimReply (safetensors): ~64 bytes per token, so a long-horizon
micro-batch is far above gRPC's 4 MiB default; both ends lift the limit."""


def weights_ref(hub: TrainerHub, manifest: TensorManifest) -> gyre_pb2.WeightsRef:
    """The WeightsRef naming a published version: its file (where there is one) and its Mooncake manifest."""
    file = hub.file_ref(manifest.version)
    return gyre_pb2.WeightsRef(version=manifest.version, location=file.location, sha256=file.sha256,
                               peer_session=hub.endpoint.session_id, manifest=manifest.to_json())


class TrainerServicer(gyre_pb2_grpc.TrainerServicer):
    """``gyre.v1.Trainer`` over a hub. Refusals a satellite can act on come back in the reply (``ok=False``,
    ``status="released"``); a call before the core is attached ends with UNAVAILABLE."""

    def __init__(self, hub: Callable[[], TrainerHub | None], pool: ThreadPoolExecutor,
                 join_transfer: Callable[[], float] | None = None, link_pool: ThreadPoolExecutor | None = None,
                 ) -> None:
        self._hub, self._pool, self._join_transfer, self._link_pool = hub, pool, join_transfer, link_pool

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[..., Any], *args: Any) -> Any:
        hub = self._hub()
        if hub is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the core's trainer is not ready yet")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(hub, *args))

    async def Join(self, request: gyre_pb2.TrainerJoin, context: grpc.aio.ServicerContext) -> gyre_pb2.TrainerJoined:
        transfer_s = request.transfer_s
        if self._join_transfer is not None and self._link_pool is not None:
            # an emulated core's link: the satellite's pull shares it with the others' and a publish, and
            # `satellite_joined` records what the pull took there, as `gyre sim` does
            waited = await asyncio.get_running_loop().run_in_executor(self._link_pool, self._join_transfer)
            transfer_s += waited
        try:
            joined: Joined = await self._call(context, TrainerHub.join, request.cell_id, request.transfer_session,
                                              transfer_s)
        except (StepProtocolError, TransferError) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        hub = self._hub()
        assert hub is not None
        return gyre_pb2.TrainerJoined(step=joined.step, weights=weights_ref(hub, joined.manifest),
                                      gradient_slot=joined.slot.to_json(), lease_s=joined.lease_s)

    async def Claim(self, request: gyre_pb2.ClaimRequest, context: grpc.aio.ServicerContext) -> gyre_pb2.ClaimReply:
        try:
            granted: Granted = await self._call(context, TrainerHub.claim, request.cell_id, request.policy_version)
        except (StepProtocolError, TransferError) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        reply = gyre_pb2.ClaimReply(status=granted.status, step=granted.step, micro_step=granted.micro_step,
                                    batch=granted.batch)
        if granted.manifest is not None:
            hub = self._hub()
            assert hub is not None
            reply.weights.CopyFrom(weights_ref(hub, granted.manifest))
        return reply

    async def _ack(self, context: grpc.aio.ServicerContext, fn: Callable[..., Any], *args: Any) -> gyre_pb2.TrainerAck:
        try:
            await self._call(context, fn, *args)
        except (StepProtocolError, TransferError) as e:
            return gyre_pb2.TrainerAck(ok=False, error=str(e))
        return gyre_pb2.TrainerAck(ok=True)

    async def Finish(self, request: gyre_pb2.MicroStepDone, context: grpc.aio.ServicerContext) -> gyre_pb2.TrainerAck:
        try:
            result = result_from_json(request.result)
        except StepProtocolError as e:
            return gyre_pb2.TrainerAck(ok=False, error=str(e))
        return await self._ack(context, TrainerHub.finish, request.cell_id, request.step, request.micro_step, result)

    async def Gradients(self, request: gyre_pb2.GradientsWritten,
                        context: grpc.aio.ServicerContext) -> gyre_pb2.TrainerAck:
        return await self._ack(context, TrainerHub.gradients, request.cell_id, request.step, list(request.micro_steps))

    async def Leave(self, request: gyre_pb2.TrainerLeave, context: grpc.aio.ServicerContext) -> gyre_pb2.TrainerAck:
        return await self._ack(context, TrainerHub.leave, request.cell_id, request.reason)

    async def Heartbeat(self, request: gyre_pb2.TrainerHeartbeat,
                        context: grpc.aio.ServicerContext) -> gyre_pb2.TrainerAck:
        known = await self._call(context, TrainerHub.heartbeat, request.cell_id)
        return gyre_pb2.TrainerAck(ok=bool(known), error="" if known else f"{request.cell_id} is not a member: join")


class TrainerServer:
    """The Trainer service of the core cell, on its own event-loop thread.

    ``start()`` binds (port 0: any free one) and returns ``host:port``; ``attach(coordinator, core)`` makes
    the hub once the core's trainer exists (calls before it end with UNAVAILABLE) and hands it to the core
    (``core.satellites``), so its ``train_step`` waits for satellites' gradients; ``stop()`` ends it."""

    def __init__(self, *, secret: str, endpoint: TransferEndpoint, host: str = "127.0.0.1", port: int = 0,
                 lease_s: float = DEFAULT_LEASE_S, advertise: str = "", tls: TlsSection | None = None,
                 join_transfer: Callable[[], float] | None = None) -> None:
        """Binds ``host``; satellites dial ``advertise`` (default ``host``). ``join_transfer`` (an emulated
        accelerator whose core link is shared: `gyre.emulate.Pacer.transfer`) blocks for one satellite's
        weight pull before its join is answered."""
        self.secret, self.endpoint, self.host, self.port, self.lease_s = secret, endpoint, host, port, lease_s
        self.advertise, self.tls, self.join_transfer = advertise or host, tls, join_transfer
        self.hub: TrainerHub | None = None
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="gyre-trainer-rpc")
        self._link_pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="gyre-core-link")
        """Satellites' pulls waiting on the shared link: their own threads, never those claims need."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self.address = ""

    def start(self) -> str:
        ready = threading.Event()
        failure: list[BaseException] = []

        async def serve() -> None:
            self._stopping = asyncio.Event()
            server = grpc.aio.server(interceptors=[SecretInterceptor(self.secret)], options=MESSAGE_OPTIONS)
            servicer = TrainerServicer(lambda: self.hub, self._pool, self.join_transfer, self._link_pool)
            gyre_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
            port = add_port(server, f"{bracket(self.host)}:{self.port}", self.tls)
            if port == 0:
                raise OSError(f"the Trainer service cannot bind {self.host}:{self.port}")
            await server.start()
            self.address = f"{bracket(self.advertise)}:{port}"
            ready.set()
            await self._stopping.wait()
            await server.stop(grace=1.0)

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(serve())
            except BaseException as e:  # reported to start(); the thread ends
                failure.append(e)
                ready.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="gyre-trainer-service", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failure:
            raise failure[0]
        if not self.address:
            raise RuntimeError("the Trainer service did not start within 30 s")
        return self.address

    def attach(self, coordinator: StepCoordinator, core: Any, *, backend: TrainerBackend | None = None,
               core_cell: str | None = None) -> TrainerHub:
        """Serve the core's ``coordinator``; ``core`` (a ``LocalCoreTrainer``, or None) gets the hub as
        ``core.satellites``. ``backend``/``core_cell`` default to the core's."""
        backend = backend if backend is not None else core.backend
        cell = core_cell if core_cell is not None else core.cell_id
        sizes = [g.numel() for g in backend.gradient_buffers()]
        backend.zero_grad()
        hub = TrainerHub(coordinator, self.endpoint, core_cell=cell, gradient_sizes=sizes, lease_s=self.lease_s)
        # the weights as they are now, so a satellite (or engine) can pull before the first step opens. Served
        # only once they are: a Join that found the hub with nothing published was refused for good (chaos seed
        # 8: a satellite joined a restarted core between the two), where "not ready yet" is retried
        hub.publish(backend.policy_version, list(backend.named_tensors()))
        self.hub = hub
        if core is not None:
            core.satellites = hub
        return hub

    def release_cell(self, cell_id: str, reason: str) -> list[int]:
        """The controller lost ``cell_id`` (or took it back): release its micro-steps now, not after its lease."""
        return self.hub.release_cell(cell_id, reason) if self.hub is not None else []

    def manifest(self, version: int) -> bytes:
        """The Mooncake manifest of a published ``version`` (b"" when it is not held: read the file)."""
        if self.hub is None:
            return b""
        try:
            return self.hub.publisher.manifest(version).to_json()
        except TransferError:
            return b""

    def stop(self) -> None:
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stopping.set)
        if self._thread is not None:
            self._thread.join(10)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._link_pool.shutdown(wait=False, cancel_futures=True)
        if self.hub is not None:
            self.hub.close()
            self.hub = None
