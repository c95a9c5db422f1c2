"""The log sink: an awaited event is on disk; concurrent calls share fsyncs (group commit)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gyre.errors import LogClosedError, LogError
from gyre.events.models import ModelCallStarted
from gyre.log import LogReader, LogWriter
from gyre.sink import EventSink, LogSink, MemorySink


def _event(i: int) -> ModelCallStarted:
    return ModelCallStarted(execution_id="e", call_id=f"c{i}", cell_id="cell0")


def test_durable_means_readable_and_commits_are_grouped(tmp_path: Path) -> None:
    writer = LogWriter(tmp_path / "log", run_id="r")
    sink = LogSink(writer)
    assert isinstance(sink, EventSink) and isinstance(MemorySink(), EventSink)

    async def call(i: int) -> None:
        await asyncio.sleep(0)
        await sink.durable(sink.record(_event(i)))

    async def main() -> None:
        await asyncio.gather(*(call(i) for i in range(200)))

    asyncio.run(main())
    assert writer.durable_seq == 199
    assert sorted(e.call_id for e in LogReader(tmp_path / "log").events()) == sorted(f"c{i}" for i in range(200))
    assert writer.stats.fsyncs < 100  # 200 acknowledged events, far fewer fsyncs
    sink.close()


def test_a_failing_commit_fails_the_waiters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = LogWriter(tmp_path / "log")

    def broken(upto: int | None = None) -> int:
        raise LogClosedError("disk gone")

    monkeypatch.setattr(writer, "commit", broken)
    sink = LogSink(writer, close_writer=False)

    async def main() -> None:
        with pytest.raises(LogError, match="disk gone"):
            await sink.durable(sink.record(_event(0)))
        with pytest.raises(LogError, match="disk gone"):  # and every later one
            await sink.durable(sink.record(_event(1)))

    asyncio.run(main())
    sink.close()
    monkeypatch.undo()
    writer.close()
