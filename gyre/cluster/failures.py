"""The rule for a failed command: transient → sent again with bounded backoff; fatal → the run ends.

A command the controller sends to a cell or the proxy can fail in two ways, and each has one answer:

- **transient** — its target or a peer it needs is restarting, not ready, unreachable or lost, or a deadline
  passed (gRPC UNAVAILABLE / DEADLINE_EXCEEDED / ABORTED / RESOURCE_EXHAUSTED, a connection or transfer
  error, an engine that does not answer, the peer declared lost). The same command may succeed later: it is
  sent again after 0.5, 1, 2, ... s (capped), up to ``Backoff.attempts`` sends — unless it cannot be sent
  again safely (`Rule.ONCE`: ``train``, ``queue``, ``stop``), or the decision it served is obsolete (its
  target's incarnation was lost or replaced, the core it joins was replaced, the run is stopping). Then it
  is *abandoned* (`Abandoned`, a `PeerLost`: the action that sent it is cut short, never the run), and the
  owner records ``command_abandoned``. A target that is still the same live process after its command was
  abandoned is declared lost: it is restarted clean, and the existing lost-cell path (re-registration,
  a step trained again, executions submitted again) redoes what the command was for.
- **fatal** — anything else: a bad config, a corrupt checkpoint or checksum mismatch, an unknown command,
  a programming error. Sending it again would fail the same way: the run ends with one line naming the
  command, its target and the cause (`CommandFailed`).

The process that ran the command classifies its exception (`is_transient`, by type, never by message text)
and reports it in ``CommandDone.retryable``; the controller reads only that flag. Every command kind has a
`Rule` (``CELL_RULES`` / ``PROXY_RULES``; a test fails when the proto gains a kind without one).
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from gyre.cluster.errors import ClusterError, PeerLost, Unavailable
from gyre.cluster.proto import gyre_pb2
from gyre.engine.errors import EngineTimeoutError, EngineUnreachableError
from gyre.errors import ConfigError, EventValidationError, GyreError, LogCorruptionError, TransferError
from gyre.events.models import CommandAbandoned

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 3600.0
"""A command's longest wait (a train step of a real model can take long); a lost cell fails it sooner."""

TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED})
"""gRPC codes of a peer that is restarting, not ready yet, overloaded, or slower than the deadline."""

TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    ConnectionError, TimeoutError, EngineUnreachableError, EngineTimeoutError, TransferError, Unavailable)
"""Exceptions of a peer that is gone or not answering for now."""

FATAL_TYPES: tuple[type[BaseException], ...] = (
    ConfigError, EventValidationError, LogCorruptionError, ValueError, TypeError, KeyError, AttributeError,
    AssertionError, NotImplementedError)
"""Exceptions that say the command, its input or the code is wrong: checked before a wrapped cause."""


def is_transient(error: BaseException) -> bool:
    """Whether a command that raised ``error`` may succeed when sent again (see the module docstring). A
    Gyre error raised ``from`` a transient cause (a satellite whose core went away) is transient too."""
    if isinstance(error, grpc.RpcError) and callable(getattr(error, "code", None)):
        return error.code() in TRANSIENT_CODES
    if isinstance(error, TRANSIENT_TYPES):
        return True
    if isinstance(error, FATAL_TYPES):
        return False
    cause = error.__cause__
    return isinstance(error, GyreError) and cause is not None and is_transient(cause)


def failed_done(command_id: int, error: BaseException) -> gyre_pb2.CommandDone:
    """A process's `CommandDone` for a command whose handler raised ``error``."""
    return gyre_pb2.CommandDone(command_id=command_id, ok=False, error=f"{type(error).__name__}: {error}",
                                retryable=is_transient(error), error_type=type(error).__name__)


class Rule(enum.Enum):
    RETRY = "retry"
    """Idempotent on the process: sent again with backoff while transient failures last."""
    ONCE = "once"
    """Not safe to send twice (a step trained, executions queued, a stop): abandoned at its first transient
    failure; its target is declared lost, and the lost-peer path redoes the work."""


CELL_RULES: dict[str, Rule] = {
    "serve": Rule.RETRY, "pause": Rule.RETRY, "release": Rule.RETRY, "load_weights": Rule.RETRY,
    "join_step": Rule.RETRY, "leave": Rule.RETRY, "sync": Rule.RETRY,
    "to_rollout": Rule.RETRY, "to_training": Rule.RETRY,  # their steps in turn, each safe to do again
    "train": Rule.ONCE, "stop": Rule.ONCE,
}
PROXY_RULES: dict[str, Rule] = {
    "routing": Rule.RETRY, "redirect": Rule.RETRY, "redirects": Rule.RETRY, "sync": Rule.RETRY,
    "queue": Rule.ONCE, "stop": Rule.ONCE,
}


@dataclass(frozen=True)
class Backoff:
    """Bounded exponential backoff: ``first_s`` doubling up to ``cap_s``, at most ``attempts`` sends
    (about two minutes in all by default: long enough for a core to restore its trainer)."""

    attempts: int = 10
    first_s: float = 0.5
    cap_s: float = 30.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait after the ``attempt``-th send failed (1-based)."""
        return min(self.cap_s, self.first_s * 2 ** (attempt - 1))


def one_line(text: str, limit: int = 400) -> str:
    """An error's text on one line (a gRPC error's repr spans several), cut at ``limit`` characters."""
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[:limit - 3] + "..."


class CommandFailed(ClusterError):
    """A process reported that a command failed; one line names the command, its target and the cause."""

    def __init__(self, what: str, done: gyre_pb2.CommandDone) -> None:
        super().__init__(f"{what} failed{'' if done.retryable else ' (fatal)'}: {one_line(done.error)}")
        self.what, self.done = what, done

    @property
    def retryable(self) -> bool:
        return self.done.retryable


class Abandoned(PeerLost):
    """A command given up on after transient failures: the action that sent it is cut short, not the run."""

    def __init__(self, what: str, *, command: str, reason: str, attempts: int, stale: bool,
                 cell_id: str | None = None, incarnation: str = "") -> None:
        super().__init__(f"{what} abandoned after {attempts} attempt{'s' * (attempts != 1)}: {reason}")
        self.what, self.command, self.reason, self.attempts = what, command, reason, attempts
        self.stale = stale
        """The decision it served is obsolete (its target lost or replaced, the run stopping); False: its
        target is still the process it was sent to, which is then declared lost (restarted clean)."""
        self.cell_id, self.incarnation = cell_id, incarnation

    def event(self, switch_to: str | None = None) -> CommandAbandoned:
        """The ``command_abandoned`` event; ``switch_to``: the role switch it ends (the cell stays in its role)."""
        return CommandAbandoned(cell_id=self.cell_id, command=self.command, target="cell" if self.cell_id else "proxy",
                                reason=one_line(self.reason), attempts=self.attempts,
                                incarnation=self.incarnation or None, switch_to=switch_to)


def wait_done(future: Future[gyre_pb2.CommandDone], what: str) -> gyre_pb2.CommandDone:
    """The command's `CommandDone`; `CommandFailed` when the process reports a failure."""
    done = future.result(COMMAND_TIMEOUT_S)
    if not done.ok:
        raise CommandFailed(what, done)
    return done


def transient(error: BaseException) -> bool:
    """The controller's side: a failed command worth sending again (the process said so, or its target
    is gone or not connected yet); anything else is fatal."""
    if isinstance(error, CommandFailed):
        return error.retryable
    return isinstance(error, (ClusterError, TimeoutError))


def perform(send: Callable[[], gyre_pb2.CommandDone], what: str, *, command: str, rule: Rule,
            obsolete: Callable[[], str | None], wait: Callable[[float], bool], backoff: Backoff = Backoff(),
            cell_id: str | None = None, incarnation: str = "") -> gyre_pb2.CommandDone:
    """Send a command under the rule: its `CommandDone`; raises a fatal failure as it is, and `Abandoned`
    once a transient one is given up. ``obsolete()``: why the decision it serves no longer holds (None: it
    holds); ``wait(s)``: sleep ``s`` seconds, True when the run began stopping meanwhile."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return send()
        except Exception as error:
            if not transient(error):
                raise
            reason, stale = obsolete(), True
            if reason is None and isinstance(error, PeerLost):
                reason = str(error)
            if reason is None and (rule is Rule.ONCE or attempt >= backoff.attempts):
                reason, stale = f"{one_line(str(error))} (no more attempts: {rule.value})", False
            if reason is None:
                log.warning("%s failed (transient, attempt %d of %d); sent again in %.1f s: %s", what, attempt,
                            backoff.attempts, backoff.delay(attempt), one_line(str(error)))
            if reason is None and wait(backoff.delay(attempt)):
                reason = "the run is stopping"
            if reason is None:
                reason = obsolete()  # what changed while it waited: never sent again for a replaced peer
            if reason is not None:
                raise Abandoned(what, command=command, reason=reason, attempts=attempt, stale=stale,
                                cell_id=cell_id, incarnation=incarnation) from error
