"""Group commit as a write / sync pipeline: commits that do not wait, concurrent producers of both
append paths, a producer still framing when a commit comes, and a failed fsync."""

import errno
import random
import threading
from pathlib import Path

import pytest

from gyre.errors import LogClosedError
from gyre.events import encode
from gyre.events.models import RewardRecorded
from gyre.log import LogReader, LogWriter
from gyre.log import writer as writer_module
from tests.conftest import Threads


def _reward(name: str) -> RewardRecorded:
    return RewardRecorded(execution_id=name, reward=0.5)


def _batch(names: list[str]):
    return encode([_reward(n) for n in names], 0).drop_columns(["seq", "ts"])


class _HeldSync:
    """Stands in for ``os.fdatasync`` in the writer: blocks every sync until released, counting them."""

    def __init__(self, real) -> None:
        self.real, self.release, self.entered = real, threading.Event(), threading.Event()
        self.calls = 0

    def __call__(self, fd: int) -> None:
        self.calls += 1
        self.entered.set()
        assert self.release.wait(10), "the test never released the sync"
        self.real(fd)


class _HeldFraming:
    """Stands in for the writer's framing: a thread named ``slow-producer`` stops in it until released."""

    def __init__(self, monkeypatch) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.real = writer_module.batch_frame_parts
        monkeypatch.setattr(writer_module, "batch_frame_parts", self)

    def __call__(self, *args, **kwargs):
        if threading.current_thread().name == "slow-producer":
            self.entered.set()
            assert self.release.wait(10)
        return self.real(*args, **kwargs)

    def start_producer(self, writer: LogWriter, names: list[str]) -> threading.Thread:
        """A producer appending ``names`` as a batch; returns once its seqs are taken and it is framing."""
        producer = threading.Thread(target=writer.append_batch, args=(_batch(names),), name="slow-producer")
        producer.start()
        assert self.entered.wait(10)
        return producer


def test_commit_without_waiting_returns_while_the_disk_syncs(log_dir: Path, monkeypatch) -> None:
    held = _HeldSync(writer_module.os.fdatasync)
    with LogWriter(log_dir) as writer:
        monkeypatch.setattr(writer_module.os, "fdatasync", held)
        seqs = writer.append([_reward(f"e{i}") for i in range(3)])
        assert writer.commit(wait=False) < seqs.last  # returned although the sync is held
        assert held.entered.wait(10)  # ... and the flusher is syncing those events
        assert writer.durable_seq < seqs.last
        held.release.set()
        assert writer.commit() == seqs.last
    assert [e.execution_id for e in LogReader(log_dir).events()] == ["e0", "e1", "e2"]


def test_commits_during_a_sync_are_coalesced_into_the_next_one(log_dir: Path, monkeypatch) -> None:
    held = _HeldSync(writer_module.os.fdatasync)
    with LogWriter(log_dir) as writer:
        monkeypatch.setattr(writer_module.os, "fdatasync", held)
        writer.append(_reward("first"))
        first = Threads(writer.commit)
        assert held.entered.wait(10)
        # While that sync is held, eight more producers append and commit: they all wait on one sync.
        others = Threads(*(lambda i=i: writer.commit(writer.append(_reward(f"w{i}")).last) for i in range(8)))
        for _ in range(1000):  # until all eight are written (in seq order, so seq 8 means all)
            if writer._written_seq == 8:
                break
            threading.Event().wait(0.01)
        held.release.set()
        first.join()
        others.join()
        assert writer.durable_seq == 8
        assert held.calls == 2
    assert len(list(LogReader(log_dir).events())) == 9


def test_a_commit_waits_for_a_producer_still_framing_its_batch(log_dir: Path, monkeypatch) -> None:
    framing = _HeldFraming(monkeypatch)
    with LogWriter(log_dir) as writer:
        producer = framing.start_producer(writer, ["slow0", "slow1"])  # seqs 0-1 taken, frame not built
        after = writer.append(_reward("after"))
        assert after.first == 2
        committer = threading.Thread(target=writer.commit)
        committer.start()
        committer.join(0.2)
        assert committer.is_alive() and writer.durable_seq == -1  # waiting for the frame, not skipping it
        framing.release.set()
        producer.join(10)
        committer.join(10)
        assert writer.durable_seq == 2
    assert [e.execution_id for e in LogReader(log_dir).events()] == ["slow0", "slow1", "after"]


def test_many_producers_mixing_both_append_paths_and_commit_modes(log_dir: Path) -> None:
    appended: dict[int, str] = {}
    with LogWriter(log_dir, segment_bytes=64 << 10) as writer:  # small segments: rotations mid-run
        def produce(worker: int) -> None:
            rng = random.Random(worker)
            for i in range(60):
                names = [f"w{worker}-{i}-{k}" for k in range(rng.randint(1, 20))]
                seqs = (writer.append([_reward(n) for n in names]) if rng.random() < 0.5
                        else writer.append_batch(_batch(names)))
                appended.update(zip(range(seqs.first, seqs.last + 1), names, strict=True))
                if rng.random() < 0.3:
                    writer.commit(wait=False)
                else:
                    assert writer.commit(seqs.last) >= seqs.last

        Threads(*(lambda w=w: produce(w) for w in range(8))).join()
    events = list(LogReader(log_dir).events())
    assert len(LogReader(log_dir).segments()) > 1
    assert [e.seq for e in events] == list(range(len(appended)))
    assert all(appended[e.seq] == e.execution_id for e in events)  # every event sits at the seq it was given


def test_a_failed_fsync_fails_every_committer_and_keeps_what_was_durable(log_dir: Path, monkeypatch) -> None:
    with LogWriter(log_dir) as writer:
        writer.append(_reward("durable"))
        writer.commit()

        def broken(fd: int) -> None:
            raise OSError(errno.EIO, "input/output error")

        monkeypatch.setattr(writer_module.os, "fdatasync", broken)
        errors: list[BaseException] = []

        def commit_one(i: int) -> None:
            try:
                writer.commit(writer.append(_reward(f"lost{i}")).last)
            except BaseException as error:
                errors.append(error)

        Threads(*(lambda i=i: commit_one(i) for i in range(4))).join()
        assert len(errors) == 4
        assert all(isinstance(e, OSError | LogClosedError) for e in errors)
        assert any("input/output error" in str(e) or "input/output error" in repr(e.__cause__) for e in errors)
        with pytest.raises(LogClosedError, match="failed and accepts nothing more"):
            writer.append(_reward("later"))
        monkeypatch.undo()
    assert next(e.execution_id for e in LogReader(log_dir).events()) == "durable"


def test_commit_beyond_the_last_appended_seq_is_refused(log_dir: Path) -> None:
    with LogWriter(log_dir) as writer:
        writer.append(_reward("e"))
        with pytest.raises(ValueError, match="last appended seq is 0"):
            writer.commit(5)


def test_a_group_commit_window_gathers_commits_into_one_sync(log_dir: Path) -> None:
    with LogWriter(log_dir, group_commit_window_s=0.5) as writer:
        Threads(*(lambda i=i: writer.commit(writer.append(_reward(f"w{i}")).last) for i in range(8))).join()
        assert writer.durable_seq == 7
        assert writer.stats.fsyncs <= 2  # without the window, each of the first commits syncs on its own


def test_group_commit_from_many_threads(log_dir: Path) -> None:
    with LogWriter(log_dir) as writer:
        def produce(worker: int) -> None:
            for i in range(50):
                seqs = writer.append(_reward(f"w{worker}-{i}"))
                assert writer.commit(seqs.last) >= seqs.last

        Threads(*(lambda w=w: produce(w) for w in range(16))).join()
        assert writer.stats.fsyncs < 16 * 50  # commits were coalesced
    ids = [e.execution_id for e in LogReader(log_dir).events()]
    assert sorted(ids) == sorted(f"w{w}-{i}" for w in range(16) for i in range(50))


def test_nothing_counts_as_durable_after_a_failed_fsync(log_dir: Path, monkeypatch) -> None:
    """Linux reports a writeback error to one fsync and marks the pages clean, so the next fsync of the
    same file succeeds without them: a sync queued behind the failed one must not publish anything."""
    real = writer_module.os.fdatasync
    entered, release = threading.Event(), threading.Event()
    calls = []

    def error_once(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            entered.set()
            assert release.wait(10)
            raise OSError(errno.EIO, "input/output error")
        real(fd)

    with LogWriter(log_dir) as writer:
        monkeypatch.setattr(writer_module.os, "fdatasync", error_once)
        writer.append(_reward("a"))
        first = Threads(writer.commit)  # syncs inline, and fails
        assert entered.wait(10)
        writer.append(_reward("b"))
        writer.commit(wait=False)  # the flusher queues behind the failing sync
        release.set()
        with pytest.raises(OSError, match="input/output error"):
            first.join()
        with pytest.raises(LogClosedError, match="failed and accepts nothing more"):
            writer.commit()
        assert writer.durable_seq == -1
        assert len(calls) == 1  # no second fsync ran


def test_an_interrupt_while_waiting_for_a_frame_loses_nothing(log_dir: Path, monkeypatch) -> None:
    framing = _HeldFraming(monkeypatch)
    with LogWriter(log_dir) as writer:
        producer = framing.start_producer(writer, ["x0", "x1"])
        writer.append(_reward("after"))

        def interrupted(timeout=None):  # Ctrl-C lands while the commit waits for the frame
            raise KeyboardInterrupt

        monkeypatch.setattr(writer._framed, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            writer.commit()
        monkeypatch.undo()
        framing.release.set()
        producer.join(10)
        assert writer.commit() == 2  # the group went back to the buffer: the next commit writes it
    assert [e.execution_id for e in LogReader(log_dir).events()] == ["x0", "x1", "after"]


def test_close_refuses_appends_from_its_start_and_keeps_every_accepted_one(log_dir: Path) -> None:
    accepted: list[str] = []
    writer = LogWriter(log_dir)
    started = threading.Event()

    def produce(worker: int) -> None:
        for i in range(100_000):
            try:
                writer.append(_reward(f"w{worker}-{i}"))
            except LogClosedError:
                return
            accepted.append(f"w{worker}-{i}")
            started.set()

    producers = Threads(*(lambda w=w: produce(w) for w in range(3)))
    assert started.wait(10)
    writer.close()
    producers.join()
    assert sorted(e.execution_id for e in LogReader(log_dir).events()) == sorted(accepted)


def test_a_writer_used_from_one_thread_runs_no_flusher(log_dir: Path) -> None:
    with LogWriter(log_dir, seal=False) as writer:
        for i in range(20):
            writer.commit(writer.append(_reward(f"e{i}")).last)
        assert writer._flusher is None  # every commit synced inline: no thread was needed
        writer.commit(writer.append(_reward("late")).last, wait=False)
        assert writer._flusher is not None


def test_a_commit_without_waiting_waits_once_too_much_is_unsynced(log_dir: Path, monkeypatch) -> None:
    held = _HeldSync(writer_module.os.fdatasync)
    with LogWriter(log_dir, max_unsynced_bytes=1) as writer:
        monkeypatch.setattr(writer_module.os, "fdatasync", held)
        writer.append(_reward("e0"))
        committer = threading.Thread(target=writer.commit, kwargs={"wait": False})
        committer.start()
        assert held.entered.wait(10)
        committer.join(0.2)
        assert committer.is_alive()  # its bytes are written, the sync is held: it waits for the backlog
        held.release.set()
        committer.join(10)
        assert not committer.is_alive() and writer.durable_seq == 0
