"""Who starts a cluster run's processes (``[cluster] launcher``), and the one interface the controller uses.

- ``local``: subprocesses of the controller, supervised through pid files (`gyre.cluster.supervisor`);
- ``ray``: Ray actors placed by a placement group, one bundle per cell (`gyre.cluster.ray_launcher`);
- ``manual``: nobody: each cell and the proxy is started by hand, by systemd, ``srun`` or a pod
  (`gyre cell --controller HOST:PORT`), with the run secret in ``GYRE_RUN_SECRET``. The controller starts,
  restarts and kills nothing; a lost process is a lost cell until someone starts it again (its new
  incarnation registers as a restarted cell does).

Whichever starts them, the processes are the same and connect the same way; a loss is the hub's (missed
heartbeats, an ended stream) or the launcher's (``on_exit``: a process, actor or node gone), handled by the
same fault path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol


class Launcher(Protocol):
    def start(self, adopt: bool) -> dict[str, str]:
        """Start every process (or, with ``adopt``, take over those still running); returns name -> how."""
        ...

    def starts(self, name: str) -> int:
        """How many times this launcher started the process (compared at hello and at loss: the same count
        means the lost incarnation is the one still running)."""
        ...

    def said_hello(self, name: str) -> None: ...

    def kill(self, name: str) -> None:
        """End a process declared lost that may still run (hung); the launcher starts it again."""
        ...

    def terminate(self, name: str) -> None:
        """SIGTERM a process the run could not tell to stop (it closes as on a stop command)."""
        ...

    def stop_watching(self) -> None: ...

    def alive(self, name: str) -> bool: ...

    def reap(self, timeout_s: float = 30.0) -> None:
        """Wait for every process to exit (terminate what is left)."""
        ...


class ManualLauncher:
    """``launcher = "manual"``: the processes are started elsewhere; liveness is the hub's."""

    def __init__(self, names: Iterable[str], connected: Callable[[str], bool]) -> None:
        self.names = list(names)
        self.connected = connected

    def start(self, adopt: bool) -> dict[str, str]:
        return dict.fromkeys(self.names, "by hand")

    def starts(self, name: str) -> int:
        return 0

    def said_hello(self, name: str) -> None:
        return None

    def kill(self, name: str) -> None:
        return None  # not ours to kill: the hub has fenced its incarnation

    def terminate(self, name: str) -> None:
        return None  # not ours to end

    def stop_watching(self) -> None:
        return None

    def alive(self, name: str) -> bool:
        return self.connected(name)

    def reap(self, timeout_s: float = 30.0) -> None:
        return None
