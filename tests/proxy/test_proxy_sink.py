"""The log sink: an awaited event is on disk; concurrent calls share fsyncs (group commit)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from gyre.errors import LogClosedError, LogError
from gyre.events.models import ModelCallStarted
from gyre.log import LogReader, LogWriter
from gyre.sink import EventSink, LogSink, LoopCommit, MemorySink

MODES: list[LoopCommit] = ["inline", "split", "thread"]


def _event(i: int) -> ModelCallStarted:
    return ModelCallStarted(execution_id="e", call_id=f"c{i}", cell_id="cell0")


@pytest.mark.parametrize("mode", MODES)
def test_durable_means_readable_and_commits_are_grouped(tmp_path: Path, mode: LoopCommit) -> None:
    writer = LogWriter(tmp_path / "log", run_id="r")
    sink = LogSink(writer, loop_commit=mode)
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


def test_events_nobody_waits_for_become_durable_by_themselves(tmp_path: Path) -> None:
    """The committer's ticks commit what was appended before the previous tick (so a call's own commit, ms
    later, takes its `model_call_started` along); an event no commit takes along still reaches the disk."""
    writer = LogWriter(tmp_path / "log", run_id="r")
    with LogSink(writer, flush_interval_s=0.02) as sink:
        position = sink.record(_event(0))
        deadline = time.monotonic() + 60
        while writer.durable_seq < position:
            assert time.monotonic() < deadline, "an event nobody waited for was never committed"
            time.sleep(0.01)
        assert writer.stats.fsyncs == 1
        later = sink.record(_event(1))
        while writer.durable_seq < later:
            assert time.monotonic() < deadline, "an event nobody waited for was never committed"
            time.sleep(0.01)
    assert [e.call_id for e in LogReader(tmp_path / "log").events()] == ["c0", "c1"]


@pytest.mark.parametrize("mode", MODES)
def test_a_failing_commit_fails_the_waiters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: LoopCommit) -> None:
    writer = LogWriter(tmp_path / "log")

    def broken(upto: int | None = None) -> int:
        raise LogClosedError("disk gone")

    monkeypatch.setattr(writer, "commit", broken)
    sink = LogSink(writer, close_writer=False, loop_commit=mode)

    async def main() -> None:
        with pytest.raises(LogError, match="disk gone"):
            await sink.durable(sink.record(_event(0)))
        with pytest.raises(LogError, match="disk gone"):  # and every later one
            await sink.durable(sink.record(_event(1)))

    asyncio.run(main())
    sink.close()
    monkeypatch.undo()
    writer.close()


def _committers(writer: LogWriter, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that run the writer's commits (the real ones), in order."""
    names: list[str] = []
    commit = writer.commit

    def named(upto: int | None = None, *, wait: bool = True) -> int:
        names.append(threading.current_thread().name)
        return commit(upto, wait=wait)

    monkeypatch.setattr(writer, "commit", named)
    return names


async def _burst(sink: LogSink, first: int, calls: int) -> None:
    """`calls` calls that finish in one iteration of the loop: each records its event, then awaits it."""

    async def call(i: int) -> None:
        await asyncio.sleep(0)
        await sink.durable(sink.record(_event(i)))

    await asyncio.gather(*(call(i) for i in range(first, first + calls)))


def test_a_lone_call_is_committed_on_its_loop_without_a_thread_hand_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy's common case (one call finishing at a time): no loop -> committer -> loop hand-off."""
    writer = LogWriter(tmp_path / "log")
    names = _committers(writer, monkeypatch)
    with LogSink(writer, flush_interval_s=None) as sink:

        async def main() -> None:
            for i in range(5):
                position = sink.record(_event(i))
                await sink.durable(position)
                assert writer.durable_seq >= position

        asyncio.run(main())
        assert writer.stats.fsyncs == 5
        assert names == [threading.current_thread().name] * 5


@pytest.mark.parametrize("mode", MODES)
def test_a_burst_on_one_loop_shares_one_fsync_left_to_the_committer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: LoopCommit
) -> None:
    """Calls that finish in one iteration of the loop wait for one commit; its fdatasync runs on the
    committer thread, so the loop serves the next calls meanwhile."""
    writer = LogWriter(tmp_path / "log")
    names = _committers(writer, monkeypatch)
    with LogSink(writer, flush_interval_s=None, loop_commit=mode) as sink:
        asyncio.run(_burst(sink, 0, 20))
        assert writer.durable_seq == 19
        assert names and set(names) == {"gyre-log-committer"}
        if mode != "thread":  # (there the committer may wake after the first call's wait and sync it alone)
            assert writer.stats.fsyncs == 1
        assert [e.call_id for e in LogReader(tmp_path / "log").events()] == [f"c{i}" for i in range(20)]


@pytest.mark.parametrize("mode", MODES)
def test_loops_on_several_threads_each_see_their_own_events_durable(tmp_path: Path, mode: LoopCommit) -> None:
    writer = LogWriter(tmp_path / "log")
    errors: list[BaseException] = []
    with LogSink(writer, loop_commit=mode) as sink:

        def serve(thread: int) -> None:
            async def call(i: int) -> None:
                for turn in range(5):
                    position = sink.record(_event(thread * 1000 + i * 10 + turn))
                    await sink.durable(position)
                    if writer.durable_seq < position:
                        errors.append(AssertionError(f"{position} acknowledged before it was durable"))

            async def main() -> None:
                await asyncio.gather(*(call(i) for i in range(20)))

            asyncio.run(main())

        threads = [threading.Thread(target=serve, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    assert len(list(LogReader(tmp_path / "log").events())) == 400
