"""Shared fixtures: small, realistic event streams, fresh log directories, threads that report failures, a URL
that refuses connections."""

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gyre.events.models import (
    CellRegistered,
    Event,
    ExecutionFinished,
    ExecutionQueued,
    ExecutionStarted,
    ModelCallFinished,
    ModelCallStarted,
    RewardRecorded,
)


def run_events(executions: int = 4, calls: int = 3) -> list[Event]:
    """A small run: one cell, executions with a few calls each, rewards."""
    events: list[Event] = [CellRegistered(cell_id="cell0", role="rollout", slots=4, is_core=True)]
    for e in range(executions):
        execution = f"e{e}"
        events += [ExecutionQueued(execution_id=execution, task_id=f"t{e // 2}", group_id=f"g{e // 2}"),
                   ExecutionStarted(execution_id=execution, cell_id="cell0")]
        parent = None
        for c in range(calls):
            call = f"{execution}-c{c}"
            events.append(ModelCallStarted(execution_id=execution, call_id=call, cell_id="cell0"))
            events.append(ModelCallFinished(
                execution_id=execution, call_id=call, cell_id="cell0", parent_call_id=parent,
                prefix_len=0 if parent is None else 3, prompt_delta_ids=[7, 8, 9],
                output_ids=[e, c, 42], output_logprobs=[-0.5, -0.25, -1.0]))
            parent = call
        events.append(ExecutionFinished(execution_id=execution, status="completed", duration_s=1.5))
        events.append(RewardRecorded(execution_id=execution, reward=e / executions))
    return events


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "log"


HANG_S = 600.0
"""How long a test waits for what must happen (a reply, a thread, a server) before calling it hung: a bound on a
hang, never a time a test depends on. Generous, since with the tests at nice 10 on a loaded 2-core machine a
worker can get 1% of a core."""


class Threads:
    """Run each target in its own thread; ``join`` waits for all of them and re-raises the first exception
    one raised (an assertion that fails in a thread must fail the test, not just print)."""

    def __init__(self, *targets: Callable[[], object]) -> None:
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._guarded, args=(t,), daemon=True) for t in targets]
        for thread in self.threads:
            thread.start()

    def _guarded(self, target: Callable[[], object]) -> None:
        try:
            target()
        except BaseException as error:
            self.errors.append(error)

    def join(self, timeout_s: float = HANG_S) -> None:
        for thread in self.threads:
            thread.join(timeout_s)
            assert not thread.is_alive(), f"a thread still runs after {timeout_s} s"
        if self.errors:
            raise self.errors[0]


@contextmanager
def refused_url() -> Iterator[str]:
    """`http://127.0.0.1:PORT` of a port bound here but never listened on: a connection is refused, and no
    server can take the port while the block runs (a port probed free and closed again can be bound by a test
    on the other worker before it is dialled)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


# -- tiers ---------------------------------------------------------------------------------------------------
# `make check` runs the fast tier: pure and unit tests (`-m "not integration and not slow"`). Tests that start
# engines or proxies, run harness subprocesses, a training loop, notebooks, Megatron or a browser are the
# integration tier, named here by path so that test modules need no marker of their own; `make test` runs both.
INTEGRATION = (
    "tests/engine/",
    "tests/proxy/",
    "tests/harness/",
    "tests/security/",
    "tests/train/",
    "tests/notebooks/",
    "tests/trainer/test_trainer_megatron.py",
    "tests/trainer/test_trainer_backend_conformance.py",
    "tests/cluster/test_satellite.py",  # satellite processes
    "tests/cluster/test_multihost_netns.py",  # runs across network namespaces (it probes them when imported)
    "tests/cluster/test_ray_launcher.py",  # a Ray head
    "tests/trainer/test_trainer_cli.py::test_bench_json",  # a benchmark run
    "tests/log/test_recovery.py::test_kill_minus_nine",  # crash torture: 200 killed writer processes
    "tests/controller/test_kill_resume.py",  # training loops killed and resumed (the torture alone: ~40 s)
)
"""Node id prefixes (a directory, a file, or a file and a test name)."""

SERIAL = (
    "tests/chaos/",
    # cluster runs: a controller, cell processes, a proxy (test_cluster_config and _membership are pure)
    "tests/cluster/test_cluster_elastic3.py",
    "tests/cluster/test_cluster_emulated.py",
    "tests/cluster/test_cluster_faults.py",
    "tests/cluster/test_cluster_observe.py",
    "tests/cluster/test_cluster_partial.py",
    "tests/cluster/test_cluster_resume_early.py",
    "tests/cluster/test_cluster_run.py",
    "tests/cluster/test_control_plane_bench.py",
    "tests/cluster/test_satellite.py",
    "tests/cluster/test_multihost_netns.py",
    "tests/cluster/test_ray_launcher.py",
    "tests/security/test_hostile_runs.py",
    "tests/train/",
    "tests/sft/test_learning_gain.py",  # the rest of tests/sft/ trains on one thread (SftConfig.threads = 1)
    "tests/notebooks/",
    "tests/observe/test_report.py",  # a browser
    "tests/trainer/test_trainer_megatron.py",
    "tests/trainer/test_trainer_backend_conformance.py",
    "tests/trainer/test_trainer_cli.py::test_bench_json",
    # the writer gets at most 40 ms a round: under load it writes too little (events_checked 96 of > 1000 at load ~19)
    "tests/log/test_recovery.py::test_kill_minus_nine",
    # Not here, though training loops killed and resumed: test_kill_resume.py's tests (one single-threaded loop,
    # killed at logged events, not at times) share two cores well in pass 1.
    # Not here either: the tests that abort, pause or redirect a reply while it streams (tests/engine/,
    # tests/proxy/). They hold the engine's loop (`Scheduler.hold`) or pause it from its own thread, so the
    # action lands mid-generation however loaded the machine; servers bind port 0 and report the port.
)
"""The part of the integration tier that runs whole runs of several processes or a training loop: `make test`
runs it one test at a time, after everything else has run on both cores, so that two of them never split the
two cores (the rest of the integration tier — one engine, one proxy, one harness process — shares them well).
Pure tests in these files are marked too; they are few and quick."""


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Neither tier imports modules it would deselect whole: collecting them costs seconds (Megatron's import
    alone ~7 s). The fast tier (`-m "not integration ..."`) skips the integration tier's whole modules and
    directories; `make test`'s serial pass (`-m "serial ..."`) collects only where `SERIAL` points."""
    markexpr = config.option.markexpr or ""
    serial_only = markexpr.startswith("serial") and "not serial" not in markexpr
    if "not integration" not in markexpr and not serial_only:
        return None
    try:
        relative = collection_path.relative_to(config.rootpath).as_posix()
    except ValueError:
        return None
    relative += "/" if collection_path.is_dir() else ""
    if serial_only:  # keep a directory on the way to a SERIAL prefix, and any module a prefix names
        files = [p.split("::")[0] for p in SERIAL]
        return None if any(relative.startswith(f) or f.startswith(relative) for f in files) else True
    return True if any(relative.startswith(p) for p in INTEGRATION if "::" not in p) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(INTEGRATION):
            item.add_marker(pytest.mark.integration)
        if item.nodeid.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)
