"""What every process of a cluster run does around its work: start, serve until told to stop, stop cleanly."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Protocol

log = logging.getLogger(__name__)


class Node(Protocol):
    stopped: threading.Event | bool

    def start(self) -> None: ...
    def close(self) -> None: ...


def serve_until_stopped(node: Node) -> None:
    """Start ``node``; return once the controller's ``stop`` command or SIGTERM/SIGINT ends it, closed."""
    done = threading.Event()

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
