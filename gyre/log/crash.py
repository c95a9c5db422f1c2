"""Crash torture: kill -9 a writer process at random moments, reopen, and prove nothing acknowledged is lost.

Each round forks a writer that appends deterministic events (their content is a function of their seq)
and reports every acknowledged commit through a pipe; the parent SIGKILLs it after a random delay, then
recovers the log and checks that seqs are gapless, every acknowledged seq is present, and every event is
exactly the one that was appended with that seq (nothing corrupted, nothing invented).
"""

import os
import random
import select
import signal
import struct
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from gyre.events.codec import encode
from gyre.events.models import Event, ModelCallFinished, ModelCallStarted, RewardRecorded
from gyre.log.reader import LogReader
from gyre.log.writer import LogRecoveryWarning, LogWriter

_ACK = struct.Struct("<q")


def expected_event(seq: int) -> Event:
    """The event the torture writer appends at ``seq`` (varied kinds and payload sizes)."""
    execution = f"e{seq % 13}"
    match seq % 5:
        case 0:
            return ModelCallStarted(execution_id=execution, call_id=f"c{seq}", cell_id=f"cell{seq % 3}")
        case 1:
            return RewardRecorded(execution_id=execution, reward=(seq % 101) / 100)
        case _:
            n = (seq * 7919) % 600
            return ModelCallFinished(execution_id=execution, call_id=f"c{seq}", cell_id=f"cell{seq % 3}",
                                     output_ids=[(seq + i) % 50_000 for i in range(n)],
                                     output_logprobs=[-((seq + i) % 17) / 4 for i in range(n)])


def _victim(path: Path, ack_fd: int, seed: int, segment_bytes: int) -> None:
    """Child process body: two threads append and commit forever, acknowledging each waited commit.

    They mix the event API with the columnar ``append_batch`` and waiting commits with ones that do not
    wait (``commit(wait=False)``), so kills land in every stage of the write / sync pipeline.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LogRecoveryWarning)
        writer = LogWriter(path, segment_bytes=segment_bytes)
    order = threading.Lock()  # the content of an event is a function of its seq: take seqs in turn

    def work(rng: random.Random) -> None:
        while True:
            for _ in range(rng.randint(1, 3)):
                with order:
                    first = writer.next_seq
                    events = [expected_event(s) for s in range(first, first + rng.randint(1, 24))]
                    if rng.random() < 0.5:
                        writer.append(events)
                    else:
                        writer.append_batch(encode(events, first).drop_columns(["seq", "ts"]))
            if rng.random() < 0.25:
                writer.commit(wait=False)
            else:
                os.write(ack_fd, _ACK.pack(writer.commit()))

    threading.Thread(target=work, args=(random.Random(seed + 1),), daemon=True).start()
    work(random.Random(seed))


_MAX_AWAITED_ACKS = 1
"""A round waits for 0..this many acknowledged commits before its random delay (an eighth as long after one): kills
then land after the victim has written, however slowly a loaded machine starts it (a delay alone let most rounds
die before their first commit under load), and half the rounds still kill at any point from the start."""


def _await_acks(fd: int, count: int, timeout_s: float = 60.0) -> bytes:
    """Read acknowledgements from ``fd`` until ``count`` have come, the victim died (EOF) or ``timeout_s``."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while len(data) < count * _ACK.size:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        if not (chunk := os.read(fd, 4096)):
            break
        data += chunk
    return data


@dataclass
class CrashReport:
    points: int = 0
    acknowledged: int = 0
    """Highest acknowledged seq + 1 over all rounds (events the writer promised)."""
    lost: int = 0
    torn_tails_cut: int = 0
    ambiguous_tails: int = 0
    """Recoveries that quarantined bytes nothing proved torn (a kill -9 should leave none)."""
    events_checked: int = 0
    failures: list[str] = field(default_factory=list)


def check_log(path: Path, max_acked: int) -> tuple[int, list[str]]:
    """Gapless, contains every acknowledged seq, and every event is the one appended at its seq."""
    failures = []
    reader = LogReader(path)
    reader.verify()
    expected_seq = 0
    for event in reader.events():
        if event.seq != expected_seq:
            failures.append(f"gap: expected seq {expected_seq}, found {event.seq}")
            break
        want = expected_event(expected_seq)
        got = event.model_dump(exclude={"seq", "ts", "run_id"})
        if got != want.model_dump(exclude={"seq", "ts", "run_id"}) and not _float32_equal(got, want):
            failures.append(f"seq {expected_seq}: content differs from what was appended")
            break
        expected_seq += 1
    if expected_seq - 1 < max_acked:
        failures.append(f"lost acknowledged events: log ends at {expected_seq - 1}, acknowledged {max_acked}")
    return expected_seq, failures


def _float32_equal(got: dict, want: Event) -> bool:
    import numpy as np

    expected = want.model_dump(exclude={"seq", "ts", "run_id"})
    for key, value in expected.items():
        if key == "output_logprobs":
            if not np.array_equal(np.float32(value), np.float32(got[key])):
                return False
        elif got[key] != value:
            return False
    return True


def run_crash_points(directory: Path, points: int, seed: int = 0, segment_bytes: int = 96 << 10,
                     max_delay_s: float = 0.04, points_per_log: int = 50) -> CrashReport:
    """Check ``points`` kill -9 rounds (a fresh log every ``points_per_log``); rounds killed before the
    log existed do not count."""
    rng = random.Random(seed)
    report = CrashReport()
    log_index = -1
    max_acked = -1
    point = -1  # rounds run, counted or not
    while report.points < points:
        point += 1
        if report.points // points_per_log > log_index:
            log_index = report.points // points_per_log
            max_acked = -1
        path = directory / f"log{log_index}"
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the victim
            os.close(read_fd)
            try:
                _victim(path, write_fd, seed * 100_003 + point, segment_bytes)
            finally:
                os._exit(1)
        os.close(write_fd)
        awaited = rng.randrange(_MAX_AWAITED_ACKS + 1)
        data = _await_acks(read_fd, awaited)
        time.sleep(rng.uniform(0, max_delay_s if awaited == 0 else max_delay_s / 8))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with os.fdopen(read_fd, "rb") as acks:
            data += acks.read()
        for (seq,) in _ACK.iter_unpack(data[: len(data) // _ACK.size * _ACK.size]):
            max_acked = max(max_acked, seq)
        if not path.exists() or not any(path.glob("*.seg")):
            continue  # killed before the log existed
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", LogRecoveryWarning)
            LogWriter(path, seal=False).close()
        report.torn_tails_cut += sum("torn tail" in str(w.message) for w in caught)
        report.ambiguous_tails += sum("Nothing proves" in str(w.message) for w in caught)
        checked, failures = check_log(path, max_acked)
        report.points += 1
        report.events_checked += checked
        report.acknowledged += max(0, max_acked + 1)
        if failures:
            report.lost += max(0, max_acked - checked + 1)
            report.failures.extend(f"point {point}: {f}" for f in failures)
    return report
