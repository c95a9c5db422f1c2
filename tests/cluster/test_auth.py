"""Every gRPC call must carry the run secret: the Admin service refuses a call without it or with another."""

import asyncio

import grpc
import pytest

from gyre import auth
from gyre.cluster.auth import SecretInterceptor, metadata
from gyre.cluster.proto import gyre_pb2, gyre_pb2_grpc


class _Admin(gyre_pb2_grpc.AdminServicer):
    async def Status(self, request, context):
        return gyre_pb2.StatusReply(run_id="run-1")


class _Cell(gyre_pb2_grpc.CellServicer):
    async def Connect(self, request_iterator, context):
        async for _ in request_iterator:
            yield gyre_pb2.CellDown(welcome=gyre_pb2.Welcome(run_id="run-1"))


async def _serve(secret: str) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=[SecretInterceptor(secret)])
    gyre_pb2_grpc.add_AdminServicer_to_server(_Admin(), server)
    gyre_pb2_grpc.add_CellServicer_to_server(_Cell(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_calls_need_the_run_secret() -> None:
    secret = auth.mint(auth.RUN_PREFIX)

    async def main() -> None:
        server, address = await _serve(secret)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                admin = gyre_pb2_grpc.AdminStub(channel)
                assert (await admin.Status(gyre_pb2.StatusRequest(), metadata=metadata(secret))).run_id == "run-1"
                for bad in ((), metadata(auth.mint(auth.RUN_PREFIX))):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await admin.Status(gyre_pb2.StatusRequest(), metadata=bad)
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                cell = gyre_pb2_grpc.CellStub(channel)
                hello = gyre_pb2.CellUp(hello=gyre_pb2.CellHello(cell_id="c0"))
                call = cell.Connect(iter([hello]), metadata=metadata(secret))
                assert (await call.read()).welcome.run_id == "run-1"
                call.cancel()
                stream = cell.Connect(iter([hello]), metadata=metadata(auth.mint(auth.RUN_PREFIX)))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stream.read()
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await server.stop(None)

    asyncio.run(main())
