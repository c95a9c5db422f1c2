"""What every process of a cluster run does around its work: start, serve until told to stop, stop cleanly.

A process whose link the controller refused for good (declared lost after a partition, replaced by a newer
incarnation, a wrong secret) exits non-zero instead of living on unreachable: fenced, it can never act again,
and whatever supervises it (the local launcher, systemd, an ``srun`` loop) starts a new incarnation."""

from __future__ import annotations

import gc
import logging
import signal
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)


class Link(Protocol):
    error: Exception | None
    on_failed: Callable[[Exception], None] | None


class Node(Protocol):
    stopped: threading.Event | bool
    link: Link
    """Its stream, or its first (a node with several names them all in ``links``, e.g. the proxy's lanes)."""

    def start(self) -> None: ...
    def close(self) -> None: ...


def serve_until_stopped(node: Node) -> None:
    """Start ``node``; return once the controller's ``stop`` command or SIGTERM/SIGINT ends it, closed. Exit
    (`SystemExit`, non-zero) once its link is refused for good."""
    done = threading.Event()
    links: tuple[Link, ...] = getattr(node, "links", (node.link,))
    for link in links:
        link.on_failed = lambda error: done.set()

    def on_signal(signum: int, frame: object) -> None:
        done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        node.start()
        while not done.wait(0.2):
            stopped = node.stopped
            if stopped.is_set() if isinstance(stopped, threading.Event) else stopped:
                break
    finally:
        node.close()
        # Closed, the process only exits: its ~400K objects (torch, transformers, the node) are frozen so that
        # the interpreter's exit does not garbage-collect them all (a cell's exit: 1.6-4.0 s -> 0.2-0.75 s on
        # a loaded 2-core VM; a run's end waits for every process's). Atexit handlers, the flush of stdout and
        # stderr, and destructors of what reference counts free still run; cycles go with the process.
        gc.freeze()
    error = next((link.error for link in links if link.error is not None), None)
    if error is not None:
        raise SystemExit(f"exiting: the controller refused this process for good ({error})")
