"""An asyncio loop on its own daemon thread: how the hub and a link run gRPC beside synchronous callers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

GRPC_OPTIONS: tuple[tuple[str, int], ...] = (
    # a model_call_finished of a long context carries ~1M token ids and log-probs (8 MB): far over gRPC's 4 MB
    ("grpc.max_send_message_length", 512 << 20),
    ("grpc.max_receive_message_length", 512 << 20),
)


class LoopThread:
    """Runs one event loop on a daemon thread until `stop`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.run_until_complete(self.loop.shutdown_default_executor())  # Admin's status calls
            self.loop.close()

    @property
    def here(self) -> bool:
        """Whether the caller runs on this loop's thread (where blocking on the loop would deadlock)."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, callback: Any, *args: Any) -> None:
        """Run ``callback(*args)`` on the loop soon; a no-op once the loop is closed."""
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nothing left to tell
            return

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        self.call(self.loop.stop)
        if not self.here:
            self._thread.join(timeout_s)
