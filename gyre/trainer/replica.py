"""A trainer replica's work loop, and the channel a satellite in another process uses to reach the core.

A replica asks the coordinator for a micro-step, runs forward-backward on it (gradients accumulate in its
backend), reports the result, and repeats until nothing is left to claim in the step. The core's replica
calls the ``StepCoordinator`` directly; a satellite calls a ``RemoteCoordinator`` that forwards the same
calls over a pair of queues to a thread on the core (``serve``). In a cluster the same calls travel over
the controller's gRPC service; the loop does not change.
"""

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gyre.trainer.batch import TrainBatch
from gyre.trainer.claims import Claim
from gyre.trainer.coordinator import StepCoordinator
from gyre.trainer.errors import StepProtocolError, TrainerError
from gyre.trainer.protocol import MicroStepResult, TrainerBackend


class Coordinator(Protocol):
    """What a replica needs from the core."""

    def claim(self, cell_id: str) -> Claim: ...

    def finish(self, cell_id: str, step: int, micro_step: int, result: MicroStepResult) -> None: ...

    def wait_for_work(self, timeout_s: float) -> None: ...


def work(
    backend: TrainerBackend,
    coordinator: Coordinator,
    cell_id: str,
    batch_of: Callable[[int], TrainBatch],
    *,
    timeout_s: float = 600.0,
) -> list[MicroStepResult]:
    """Claim and run micro-steps of the open step until none is left to claim; returns what this replica did."""
    deadline = time.monotonic() + timeout_s
    done: list[MicroStepResult] = []
    while True:
        claim = coordinator.claim(cell_id)
        if claim.status == "done":
            return done
        if claim.status == "wait":
            if time.monotonic() > deadline:
                raise StepProtocolError(f"{cell_id} waited {timeout_s} s for a claimable micro-step")
            coordinator.wait_for_work(0.05)
            continue
        assert claim.step is not None and claim.micro_step is not None
        result = backend.forward_backward(batch_of(claim.micro_step))
        coordinator.finish(cell_id, claim.step, claim.micro_step, result)
        done.append(result)


# -- the satellite's channel ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    method: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Reply:
    value: Any = None
    error: str | None = None


ALLOWED = frozenset({"claim", "finish", "join", "leave", "await_step", "wait_for_work"})


class RemoteCoordinator:
    """The satellite's stand-in for the core's coordinator: each call is one request and one reply."""

    def __init__(self, requests: Any, replies: Any, timeout_s: float = 600.0) -> None:
        self.requests, self.replies, self.timeout_s = requests, replies, timeout_s

    def _call(self, method: str, *args: Any) -> Any:
        self.requests.put(Request(method, args))
        try:
            reply: Reply = self.replies.get(timeout=self.timeout_s)
        except queue.Empty as e:
            raise TrainerError(f"the core did not answer {method} within {self.timeout_s} s") from e
        if reply.error is not None:
            raise StepProtocolError(f"the core refused {method}: {reply.error}")
        return reply.value

    def claim(self, cell_id: str) -> Claim:
        return self._call("claim", cell_id)

    def finish(self, cell_id: str, step: int, micro_step: int, result: MicroStepResult) -> None:
        self._call("finish", cell_id, step, micro_step, result)

    def wait_for_work(self, timeout_s: float) -> None:
        self._call("wait_for_work", timeout_s)

    def join(self, cell_id: str) -> None:
        self._call("join", cell_id)

    def leave(self, cell_id: str, reason: str = "") -> None:
        self._call("leave", cell_id, reason)

    def await_step(self, after: int) -> int | None:
        """Block until a step numbered above ``after`` is open; ``None`` once the core stops."""
        return self._call("await_step", after)


class StepGate:
    """Announces steps to satellites: which step is open, and when the core stops."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._step: int | None = None
        self._stopped = False

    def open(self, step: int) -> None:
        with self._cond:
            self._step = step
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def await_step(self, after: int) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: self._stopped or (self._step is not None and self._step > after))
            return None if self._stopped and (self._step is None or self._step <= after) else self._step


def serve(coordinator: StepCoordinator, gate: StepGate, requests: Any, replies: Any) -> threading.Thread:
    """Answer one satellite's requests on a daemon thread until it sends ``None``."""

    def loop() -> None:
        while True:
            request = requests.get()
            if request is None:
                return
            if request.method not in ALLOWED:
                replies.put(Reply(error=f"unknown method {request.method!r}"))
                continue
            target: Any = gate if request.method == "await_step" else coordinator
            try:
                replies.put(Reply(getattr(target, request.method)(*request.args)))
            except Exception as e:  # not swallowed: the satellite gets it and raises, the core keeps serving
                replies.put(Reply(error=f"{type(e).__name__}: {e}"))

    thread = threading.Thread(target=loop, name="gyre-trainer-serve", daemon=True)
    thread.start()
    return thread
