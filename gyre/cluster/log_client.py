"""The run's log as a process on another host reads it: through the controller's Log service.

The core builds each step's batch from the log and a restarted core folds it; neither may read the
controller's disk (it is on another host). `RemoteLog.read` streams a seq range; `follow` polls for what
was written since, as `LogReader.follow` tails a local log, so `LiveLogSource` takes either.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pyarrow as pa

from gyre.cluster.aio import GRPC_OPTIONS
from gyre.cluster.auth import metadata
from gyre.cluster.proto import gyre_pb2, gyre_pb2_grpc
from gyre.cluster.tls import TlsSection, channel
from gyre.events.wire import ipc_to_batch


class RemoteLog:
    def __init__(self, controller: str, *, secret: str, tls: TlsSection | None = None) -> None:
        self.controller = controller
        self._metadata = metadata(secret)
        self._channel = channel(controller, tls, GRPC_OPTIONS)
        self._stub = gyre_pb2_grpc.LogStub(self._channel)

    def read(self, from_seq: int = 0, to_seq: int = -1) -> Iterator[pa.RecordBatch]:
        """Events ``from_seq <= seq <= to_seq`` (``to_seq < 0``: all written so far), in seq order."""
        for chunk in self._stub.Read(gyre_pb2.LogRead(from_seq=from_seq, to_seq=to_seq), metadata=self._metadata):
            yield ipc_to_batch(chunk.ipc)

    def follow(self, from_seq: int = 0, poll_s: float = 0.05,
               stop: threading.Event | None = None) -> Iterator[pa.RecordBatch]:
        """What is written from ``from_seq`` on, as it is written, until ``stop`` is set: one stream the
        controller keeps open (reopened from where it was if the controller restarts)."""
        stop = stop or threading.Event()
        next_seq = from_seq
        while not stop.is_set():
            call = self._stub.Read(gyre_pb2.LogRead(from_seq=next_seq, follow=True), metadata=self._metadata)
            threading.Thread(target=lambda c=call: (stop.wait(), c.cancel()), daemon=True).start()
            try:
                for chunk in call:
                    batch = ipc_to_batch(chunk.ipc)
                    next_seq = batch.column("seq")[-1].as_py() + 1
                    yield batch
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.CANCELLED and stop.is_set():
                    return
                if error.code() != grpc.StatusCode.UNAVAILABLE:  # a restarting controller is UNAVAILABLE
                    raise
            stop.wait(poll_s)

    def close(self) -> None:
        self._channel.close()
