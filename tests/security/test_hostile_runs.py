"""The hostile harness as every rollout of a real run: `gyre train` (one process) and `gyre run` (the cluster).

The controller runs in this test's process, so an attempt to kill or ptrace it (`H_HOST_PID`) aims at the real
thing; on the cluster `H_PORT` is its gRPC port (fixed for the run), and each harness aims at a real cell's
engine HTTP port and Mooncake endpoint, which the test reads from the cells' hellos once the run is up, checks
it can reach itself from the host, and hands to the harness through its workspace. In one process a listener
stands for all of them. The harnesses run concurrently, so each one looks for its neighbours' workspaces
and tokens while they run. The run must complete, every attempt in every execution must fail, and each
execution must still reach the proxy and be scored.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from gyre.cluster.config import ClusterConfig, ClusterSchedulerSection, ClusterSection
from gyre.cluster.run import ClusterRun
from gyre.config import RolloutSection, SamplingSection, TrainConfig, TrainerSection, TrajectorySection
from gyre.events.models import ExecutionFinished, RewardRecorded
from gyre.log import LogReader
from gyre.run.host import RunHost
from gyre.train.inprocess import TrainingRun
from tests.harness.harness_helpers import REPO
from tests.security.test_hostile_harness import ATTEMPTS, HOSTILE, lines

pytestmark = pytest.mark.integration

QUICK = REPO / "tests" / "controller" / "quick"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Targets(threading.Thread):
    """Answers each harness's `targets.wanted` with a cell's engine HTTP and Mooncake addresses, once it has
    connected to both itself: from the host they are reachable, so a harness that fails to is fenced in."""

    def __init__(self, run: RunHost, run_dir: Path) -> None:
        super().__init__(name="hostile-targets", daemon=True)
        self.cluster, self.run_dir = run, run_dir
        self.stop = threading.Event()
        self.reached: list[str] = []
        self.answered: set[Path] = set()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            for wanted in self.run_dir.glob("executions/*/workspace/targets.wanted"):
                if wanted not in self.answered:
                    self.answer(wanted.parent)
                    self.answered.add(wanted)

    def answer(self, workspace: Path) -> None:
        hello = next(iter(self.cluster.topology._hellos.values()))  # what a cell said it serves
        named = {"engine": urlsplit(hello.engine_url).netloc, "mooncake": hello.transfer_session}
        for address in named.values():
            host, _, port = address.rpartition(":")
            with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
                self.reached.append(address)
        (workspace / "targets.tmp").write_text(json.dumps(named))
        (workspace / "targets.tmp").rename(workspace / "targets.json")


def hostile_setup(base: Path, run_dir: Path, port: int, **extra: str) -> tuple[Path, Path]:
    """A task set whose starting files hold hostile.py, and a harness TOML that runs it with its targets."""
    tasks = base / "tasks"
    (tasks / "files").mkdir(parents=True)
    shutil.copy(HOSTILE, tasks / "files" / "hostile.py")
    shutil.copy(QUICK / "score.py", tasks / "score.py")
    (tasks / "tasks.toml").write_text(
        'name = "hostile"\n[evaluator]\ntype = "command"\nname = "letters"\n'
        'command = ["{python}", "-S", "{taskset_dir}/score.py", "{workspace}/{answer_file}"]\ntimeout_s = 30\n'
        '[[tasks]]\nid = "hello"\nprompt = "Write the word hello into answer.txt."\nfiles_dir = "files"\n'
        '[tasks.grading]\nexpected = "hello"\n')
    env = {"H_ROLE": "hostile", "H_SECRET": str(run_dir / "secrets.toml"),
           "H_VICTIM_WORKSPACE": str(run_dir / "executions"), "H_VICTIM_PID": str(os.getpid()),
           "H_TASKSET": str(tasks / "tasks.toml"), "H_GRADER": str(tasks / "score.py"), "H_CHECKOUT": str(REPO),
           "H_PORT": str(port), "H_HOST_IP": "127.0.0.1", "H_RUN_DIR": str(run_dir), "H_HOST_PID": str(os.getpid()),
           "H_ANSWER": "answer.txt", **extra}
    harness = base / "harness.toml"
    harness.write_text('name = "hostile"\ncommand = ["{python}", "hostile.py"]\ntimeout_s = 120\n'
                       f"[env]\n{''.join(f'{k} = {json.dumps(v)}' + chr(10) for k, v in env.items())}"
                       "[limits]\nnproc = 64\nfsize_mb = 8\ntmp_mb = 16\n")
    return tasks / "tasks.toml", harness


def test_a_cluster_run_of_hostile_harnesses_completes_with_every_attempt_failed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    port = free_port()
    tasks, harness = hostile_setup(tmp_path, run_dir, port, H_TARGETS="ask")
    config = ClusterConfig(
        name="hostile", run_dir=run_dir, seed=5, steps=1,
        cluster=ClusterSection(cells=2, slots=2, core="cell0", port=port, heartbeat_s=0.5, dead_after_s=120),
        scheduler=ClusterSchedulerSection(policy="elastic", params={"hysteresis_slots": 0}),
        rollout=RolloutSection(tasks=tasks, harness=harness, task_ids=("hello",), groups_per_step=1, group_size=4,
                               timeout_s=120),
        sampling=SamplingSection(max_tokens=8),
        trajectory=TrajectorySection(token_budget=64, min_valid_per_group=2),
        trainer=TrainerSection(lr=1e-3, eps_low=0.2, eps_high=0.28),
    )
    run = ClusterRun(config)
    targets = Targets(run, run_dir)
    targets.start()
    try:
        summary = run.run()
    finally:
        targets.stop.set()
        targets.join()
    assert summary.status == "completed"
    assert len(targets.answered) >= 4 and len(targets.reached) == 2 * len(targets.answered)  # reachable outside
    check_every_execution(run_dir, summary.log)


def test_a_training_run_of_hostile_harnesses_completes_with_every_attempt_failed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen(8)
        listener.setblocking(False)
        tasks, harness = hostile_setup(tmp_path, run_dir, listener.getsockname()[1])
        config = TrainConfig(
            name="hostile", run_dir=run_dir, seed=5, steps=1,
            rollout=RolloutSection(tasks=tasks, harness=harness, task_ids=("hello",), groups_per_step=1,
                                   group_size=4, max_concurrency=4, timeout_s=120),
            sampling=SamplingSection(max_tokens=8),
            trainer=TrainerSection(lr=1e-3, eps_low=0.2, eps_high=0.28),
        )
        summary = TrainingRun(config).run()
        assert summary.status == "completed"
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the port
    check_every_execution(run_dir, run_dir / "log")


def check_every_execution(run_dir: Path, log: Path) -> None:
    secret = (run_dir / "secrets.toml").read_text() if (run_dir / "secrets.toml").exists() else None
    outputs = sorted((run_dir / "executions").glob("*/harness.stdout"))
    assert len(outputs) >= 4
    for stdout in outputs:
        said = stdout.read_text()
        assert lines(stdout, "ESCAPED") == {}, said
        assert set(lines(stdout, "BLOCKED")) == set(ATTEMPTS), said
        assert lines(stdout, "REACHED")["proxy"].startswith("200"), said
        assert said.rstrip().endswith("DONE") and (secret is None or secret not in said)
        assert not (stdout.parent / "escape.txt").exists()
    assert not (run_dir / "planted.txt").exists()
    finished = list(LogReader(log).events(kinds=["execution_finished"]))
    assert finished and all(isinstance(e, ExecutionFinished) and e.status == "completed" for e in finished)
    rewards = list(LogReader(log).events(kinds=["reward_recorded"]))
    assert len(rewards) == len(finished) and all(isinstance(e, RewardRecorded) and e.reward == 1.0 for e in rewards)
