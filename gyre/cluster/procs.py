"""Reads of ``/proc``: is a pid a live process, what is its command line, and its parent, group and session.

One place for the rules the supervisor (adopting a predecessor's processes) and the chaos benchmark (finding
what to kill) share: a zombie (``Z``) or dead (``X``) process is not running, and a command name in
``/proc/<pid>/stat`` may hold spaces and parentheses, so the fields after it are found from the last ``)``.
``proc`` is a parameter so tests can point it at a fake tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcStat:
    pid: int
    state: str
    ppid: int
    pgid: int
    sid: int


def proc_stat(pid: int, proc: Path = PROC) -> ProcStat | None:
    """The fields of ``/proc/<pid>/stat`` the callers need; None when there is no such process."""
    try:
        text = (proc / str(pid) / "stat").read_text()
        rest = text[text.rindex(")") + 2:].split()
        return ProcStat(pid, rest[0], int(rest[1]), int(rest[2]), int(rest[3]))
    except (OSError, ValueError, IndexError):  # gone, unreadable, or cut short while the process exited
        return None


def running(pid: int, proc: Path = PROC) -> bool:
    """Alive and not a zombie (an adopted process is reaped by init, a child by its parent)."""
    stat = proc_stat(pid, proc)
    return stat is not None and stat.state not in ("Z", "X")


def cmdline(pid: int, proc: Path = PROC) -> list[str]:
    """The process's argv ([] when it is gone or unreadable)."""
    try:
        return (proc / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def all_stats(proc: Path = PROC) -> list[ProcStat]:
    """Every process's `ProcStat` (processes that exit while being read are skipped)."""
    out = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name), proc)
            if stat is not None:
                out.append(stat)
    return out
