"""A full log disk: writes wait for space, nothing acknowledged is touched, and the log goes on afterwards.

The disk is made full by the positional write itself (the writer's one way to the file): it writes part of
what it was given, as a full disk does, and fails with ENOSPC until the test gives the space back.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest

from gyre.events.models import RewardRecorded
from gyre.log import LogReader, LogWriter
from gyre.log import writer as writer_module


def _events(n: int, start: int = 0) -> list[RewardRecorded]:
    return [RewardRecorded(execution_id=f"e{i}", reward=0.5) for i in range(start, start + n)]


def test_writes_wait_for_space_and_lose_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = writer_module._write_all
    full, space, hit = threading.Event(), threading.Event(), threading.Event()

    def write_all(fd: int, parts: list, offset: int) -> None:
        if full.is_set() and not space.is_set():
            import os

            os.pwrite(fd, b"\x00" * 7, offset)  # part of it landed, as on a disk that filled mid-write
            hit.set()
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fd, parts, offset)

    monkeypatch.setattr(writer_module, "_write_all", write_all)
    monkeypatch.setattr(writer_module, "DISK_FULL_POLL_S", 0.01)
    path = tmp_path / "log"
    with LogWriter(path, run_id="r") as writer:
        writer.append(_events(5))
        writer.commit()  # acknowledged before the disk fills
        full.set()
        writer.append(_events(5, start=5))
        done = threading.Event()
        committer = threading.Thread(target=lambda: (writer.commit(), done.set()), daemon=True)
        committer.start()
        assert hit.wait(10)  # the write found the disk full ...
        assert not done.is_set() and writer.durable_seq == 4  # ... and nothing past the full disk is durable
        assert [e.execution_id for e in LogReader(path).events()] == [f"e{i}" for i in range(5)]
        space.set()  # space comes back
        committer.join(10)
        assert done.is_set() and writer.durable_seq == 9 and writer.stats.disk_full_s > 0
        writer.append(_events(2, start=10))
        writer.commit()
    reader = LogReader(path)
    reader.verify()
    assert [e.execution_id for e in reader.events()] == [f"e{i}" for i in range(12)]


def test_other_write_errors_still_fail_the_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fd: int, parts: list, offset: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with LogWriter(tmp_path / "log", run_id="r") as writer:
        monkeypatch.setattr(writer_module, "_write_all", broken)
        writer.append(_events(1))
        with pytest.raises(OSError, match="Input/output error"):
            writer.commit()
        monkeypatch.undo()
