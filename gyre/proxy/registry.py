"""Executions the runner registered, found by their token. A harness only ever holds its token.

Tokens are looked up by their SHA-256 digest, so lookup time says nothing about how much of a guessed token
was right. Registration may happen from any thread (the runner's); lookups come from the proxy's loop.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field

from gyre import auth
from gyre.proxy.branches import AgentBook, MarkersConfig
from gyre.proxy.errors import UnknownExecutionError
from gyre.proxy.render import Rendered
from gyre.proxy.resend import ResendCache
from gyre.proxy.response_store import ResponseStore
from gyre.proxy.tito import CallTree, Codec


@dataclass(frozen=True, slots=True)
class Registration:
    """What a runner gets back: the token to give the harness and the cell the execution is pinned to."""

    execution_id: str
    token: str
    cell_id: str
    policy_version: int = 0
    attempt: int = 0
    """The execution's attempt (a resumed run queues an unfinished execution again): stamped on its calls."""


@dataclass(eq=False)
class ExecutionState:
    """Everything the proxy keeps per execution: the call tree (exact ids), agents, counters, the
    Responses API's stored responses, and what its last requests were read and rendered as."""

    registration: Registration
    tree: CallTree
    agents: AgentBook
    calls_started: int = 0
    drift_tokens: int = 0
    drifted_calls: int = 0
    roots: int = 0
    responses: ResponseStore = field(default_factory=ResponseStore)
    resent: ResendCache = field(default_factory=ResendCache)
    """The message arrays of its last requests (`gyre.proxy.resend`)."""
    rendered: list[Rendered] = field(default_factory=list)
    """Its last conversations' units, for the renderer to extend (`ChatRenderer.render`'s `kept`)."""

    @property
    def execution_id(self) -> str:
        return self.registration.execution_id

    def next_call_id(self) -> str:
        self.calls_started += 1
        return f"{self.execution_id}/{self.calls_started:05d}-{secrets.token_hex(3)}"


class ExecutionRegistry:
    def __init__(self, codec: Codec, markers: MarkersConfig) -> None:
        self._codec = codec
        self._markers = markers
        self._lock = threading.Lock()
        self._by_id: dict[str, ExecutionState] = {}
        self._by_token: dict[bytes, ExecutionState] = {}

    def add(self, execution_id: str, token: str | None, cell_id: str, policy_version: int = 0,
            attempt: int = 0) -> ExecutionState:
        token = auth.mint() if token is None else auth.check(token, f"token of execution {execution_id!r}")
        if not execution_id:
            raise ValueError("execution_id must be non-empty")
        registration = Registration(execution_id, token, cell_id, policy_version, attempt)
        state = ExecutionState(registration, CallTree(self._codec), AgentBook(self._markers))
        digest = auth.digest(token)
        with self._lock:
            if execution_id in self._by_id:
                raise ValueError(f"execution {execution_id!r} is already registered")
            if digest in self._by_token:
                raise ValueError("that token is already in use by another execution")
            self._by_id[execution_id] = state
            self._by_token[digest] = state
        return state

    def remove(self, execution_id: str) -> ExecutionState:
        with self._lock:
            state = self._by_id.pop(execution_id, None)
            if state is None:
                raise UnknownExecutionError(f"execution {execution_id!r} is not registered")
            self._by_token.pop(auth.digest(state.registration.token), None)
        return state

    def get(self, execution_id: str) -> ExecutionState:
        state = self._by_id.get(execution_id)
        if state is None:
            raise UnknownExecutionError(f"execution {execution_id!r} is not registered")
        return state

    def by_token(self, token: str) -> ExecutionState | None:
        return self._by_token.get(auth.digest(token))

    def __len__(self) -> int:
        return len(self._by_id)
