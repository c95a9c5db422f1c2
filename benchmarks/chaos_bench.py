"""Chaos: a 4-cell `gyre run` whose processes (controller, proxy, cells, harnesses) are SIGKILLed at seeded moments.

    python -m benchmarks.chaos_bench --kills 30 --seed 1 --json
    python -m benchmarks.chaos_bench --kills 30 --seeds 1-10 --json    # in sequence: per seed, and in total
    python -m benchmarks.chaos_bench --partitions --partition-s 30 --json   # root: benchmarks/chaos_partition.py
    python -m benchmarks.chaos_bench --kills 8 --steps 3 --emulate benchmarks/scenarios/chaos-long-steps.toml \
        --time-scale 10 --token-scale 100 --min-wait-s 10 --max-wait-s 30 --max-events 0   # kills in train steps

The run is examples/cluster-cpu.toml in a temp run directory (more steps, quicker loss detection). At each
moment drawn from a seeded RNG — once the log has grown by a drawn number of events and a drawn 1-6 s have
passed, so the run makes progress between kills — a victim class is drawn (weights ``--weights``) among the
classes with a live process, then a process of it, and SIGKILLed. A killed controller is started again with
``gyre run CONFIG --resume``; it is not killed again before one of its peers' events reached the new
one. The controller respawns cells and the proxy itself. Once ``gyre run`` exits 0 the log is audited
(`gyre.audit`: events lost or doubled, rewards lost or doubled, micro-steps redone) and replayed.

What it assumes of the controller (the contract `gyre run` keeps for it):
- ``<run_dir>/processes/controller.pid`` and ``<run_dir>/processes/<name>.pid`` (``cell0``.. and ``proxy``)
  hold the pids, a child's file rewritten when the controller respawns it;
- ``gyre run CONFIG --resume`` continues the run in the config's run_dir and adopts the running children;
- harnesses are descendants of the proxy process, each the leader of its own process group (the harness
  runner starts them with ``start_new_session``): the whole group is killed.

"Time lost per kill" is the time from the kill to the next ``reward_recorded`` or ``train_step_finished``
(whatever comes first in the log), next to the median gap between those events over the whole run.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from gyre.cluster.procs import ProcStat, all_stats, cmdline, running

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT / "examples" / "cluster-cpu.toml"
VICTIM_CLASSES = ("controller", "proxy", "cell", "harness")
DEFAULT_WEIGHTS = {"controller": 1.0, "proxy": 1.0, "cell": 2.0, "harness": 2.0}
PROGRESS_KINDS = ("reward_recorded", "train_step_finished")
BURSTS = ("cells", "core+controller", "proxy+core")
"""Kill bursts: every cell within a few seconds; the core and the controller together; the proxy and the core."""
PROCESSES_DIR = "processes"


# -- the kill schedule (pure: a seeded RNG and what is alive) --------------------------------------------------


@dataclass(frozen=True)
class Pace:
    """How long to let the run go between kills: both a drawn wall time and a drawn number of new events."""

    min_wait_s: float = 1.0
    max_wait_s: float = 6.0
    min_events: int = 1
    max_events: int = 20


class KillSchedule:
    """Seeded draws of when and whom to kill. The same seed and the same sequence of live processes give the
    same schedule; classes with no live process are left out of a draw (their weight goes to the others)."""

    def __init__(self, seed: int, weights: dict[str, float] | None = None, pace: Pace = Pace(),
                 burst_share: float = 0.0, core: str = "cell0") -> None:
        """``burst_share``: the chance that a kill moment is a burst (`BURSTS`) rather than one kill."""
        if not 0.0 <= burst_share <= 1.0:
            raise ValueError(f"burst_share {burst_share} is not in [0, 1]")
        self.rng = random.Random(seed)
        self.burst_share, self.core = burst_share, core
        self.weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        unknown = set(self.weights) - set(VICTIM_CLASSES)
        if unknown:
            raise ValueError(f"unknown victim classes {sorted(unknown)}; known: {', '.join(VICTIM_CLASSES)}")
        if not any(w > 0 for w in self.weights.values()):
            raise ValueError("every victim class has weight 0")
        self.pace = pace

    def wait(self) -> tuple[float, int]:
        """(seconds, new log events) to let pass before the next kill."""
        return (self.rng.uniform(self.pace.min_wait_s, self.pace.max_wait_s),
                self.rng.randint(self.pace.min_events, self.pace.max_events))

    def burst(self, candidates: dict[str, list[str]]) -> tuple[str, list[tuple[str, str]]] | None:
        """A burst's kind and victims (class, name) in kill order, the controller last; None: a single kill
        this time (or no process of the burst is alive)."""
        if not self.burst_share or self.rng.random() >= self.burst_share:
            return None
        kind = self.rng.choice(BURSTS)
        cells = sorted(candidates.get("cell", []))
        wanted = {"cells": [("cell", c) for c in cells],
                  "core+controller": [("cell", self.core), ("controller", "controller")],
                  "proxy+core": [("proxy", "proxy"), ("cell", self.core)]}[kind]
        victims = [(c, n) for c, n in wanted if n in candidates.get(c, [])]
        return (kind, victims) if victims else None

    def burst_gap(self) -> float:
        """Seconds between two kills of a burst ("within a few seconds")."""
        return self.rng.uniform(0.0, 2.0)

    def victim(self, candidates: dict[str, list[str]]) -> tuple[str, str] | None:
        """(class, name) drawn among ``candidates`` (class -> names of its live processes); None: nobody."""
        classes = [c for c in VICTIM_CLASSES if candidates.get(c) and self.weights.get(c, 0) > 0]
        if not classes:
            return None
        victim_class = self.rng.choices(classes, weights=[self.weights[c] for c in classes])[0]
        return victim_class, self.rng.choice(sorted(candidates[victim_class]))


def parse_weights(text: str) -> dict[str, float]:
    """``controller=1,proxy=1,cell=2,harness=2`` (classes left out weigh 0)."""
    weights = dict.fromkeys(VICTIM_CLASSES, 0.0)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in weights:
            raise ValueError(f"unknown victim class {name!r}; known: {', '.join(VICTIM_CLASSES)}")
        weights[name] = float(value)
    return weights


# -- processes (pure reads of /proc, in gyre.cluster.procs, and the run's pid files) --------------------------


def descendants(pid: int, stats: list[ProcStat]) -> list[ProcStat]:
    """Every live process below ``pid`` (children, grandchildren, ...), parents before children."""
    children: dict[int, list[ProcStat]] = {}
    for stat in stats:
        children.setdefault(stat.ppid, []).append(stat)
    out, frontier = [], [pid]
    while frontier:
        below = [s for p in frontier for s in sorted(children.get(p, []), key=lambda s: s.pid)]
        below = [s for s in below if s.state not in ("Z", "X")]
        out += below
        frontier = [s.pid for s in below]
    return out


def harnesses(proxy_pid: int, stats: list[ProcStat]) -> list[int]:
    """The harness processes under the proxy: session leaders among its descendants (the harness runner starts
    each harness in a new session); the proxy's direct children when none is."""
    below = descendants(proxy_pid, stats)
    leaders = [s.pid for s in below if s.sid == s.pid]
    return leaders or [s.pid for s in below if s.ppid == proxy_pid]


def pid_files(run_dir: Path) -> dict[str, int]:
    """name -> pid from ``<run_dir>/processes/<name>.pid`` (files being rewritten or unreadable are skipped)."""
    out = {}
    directory = run_dir / PROCESSES_DIR
    if not directory.is_dir():
        return out
    for path in sorted(directory.glob("*.pid")):
        try:
            out[path.stem] = int(path.read_text().strip())
        except ValueError:
            continue
    return out


def child_name(argv: list[str]) -> str | None:
    """The run's name of a controller child from its argv: ``gyre cell --cell-id cellN`` -> cellN,
    ``gyre proxy serve`` -> proxy."""
    if "cell" in argv and "--cell-id" in argv[:-1]:
        return argv[argv.index("--cell-id") + 1]
    if "proxy" in argv and "serve" in argv:
        return "proxy"
    return None


def children_by_argv(controller_pid: int, stats: list[ProcStat], proc: Path = Path("/proc")) -> dict[str, int]:
    """name -> pid of the controller's cells and proxy found by their argv (for a controller without pid files)."""
    out = {}
    for stat in descendants(controller_pid, stats):
        name = child_name(cmdline(stat.pid, proc))
        if name is not None and name not in out:
            out[name] = stat.pid
    return out


def candidates(run_dir: Path, controller_pid: int | None, proc: Path = Path("/proc")) -> dict[str, list[str]]:
    """Victim class -> names of its live processes: ``controller``, ``proxy``, ``cellN``, ``harness:<pid>``.
    The pid files name the cells and the proxy; without any, the controller's descendants do (by argv)."""
    pids = pid_files(run_dir)
    stats = all_stats(proc)
    if set(pids) <= {"controller"} and controller_pid is not None:
        pids = children_by_argv(controller_pid, stats, proc)
    live = {s.pid for s in stats if s.state not in ("Z", "X")}
    out: dict[str, list[str]] = {c: [] for c in VICTIM_CLASSES}
    if controller_pid is not None and controller_pid in live:
        out["controller"] = ["controller"]
    for name, pid in pids.items():
        if name == "controller" or pid not in live:
            continue
        if name == "proxy":
            out["proxy"] = ["proxy"]
            out["harness"] = [f"harness:{p}" for p in harnesses(pid, stats)]
        else:
            out["cell"].append(name)
    return out


def resolve(name: str, run_dir: Path, controller_pid: int | None) -> int | None:
    if name == "controller":
        return controller_pid
    if name.startswith("harness:"):
        return int(name.split(":", 1)[1])
    pids = pid_files(run_dir)
    if set(pids) <= {"controller"} and controller_pid is not None:
        pids = children_by_argv(controller_pid, all_stats())
    return pids.get(name)


def kill(name: str, pid: int) -> bool:
    """SIGKILL a process (a harness: its whole process group); False when it was gone already."""
    try:
        if name.startswith("harness:") and os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


# -- a full log disk ------------------------------------------------------------------------------------------


class FullDisk:
    """The run's log directory on a small tmpfs (root: ``mount``), filled to the last byte ``at_s`` seconds
    into the run and given back ``hold_s`` seconds later: the writer must wait for space, lose nothing
    acknowledged, and the run go on."""

    FILLER = ".disk-full-filler"

    def __init__(self, log_dir: Path, at_s: float, hold_s: float, size_mb: int = 256) -> None:
        self.log_dir, self.at_s, self.hold_s, self.size_mb = log_dir, at_s, hold_s, size_mb
        self.mounted = False
        self.figures: dict[str, float | int | None] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def mount(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "tmpfs", str(self.log_dir)],
                       check=True, capture_output=True)
        self.mounted = True

    def start(self, elapsed: Callable[[], float]) -> None:
        self._thread = threading.Thread(target=self._run, args=(elapsed,), name="chaos-full-disk", daemon=True)
        self._thread.start()

    def _run(self, elapsed: Callable[[], float]) -> None:
        if self._stop.wait(max(0.0, self.at_s - elapsed())):
            return
        filled = self.fill()
        self.figures.update(at_s=round(elapsed(), 3), filled_bytes=filled)
        self._stop.wait(self.hold_s)
        (self.log_dir / self.FILLER).unlink(missing_ok=True)
        self.figures.update(freed_at_s=round(elapsed(), 3))

    def fill(self) -> int:
        """Write zeros until the disk says it is full; returns the bytes written."""
        written = 0
        chunk = b"\0" * (1 << 20)
        with open(self.log_dir / self.FILLER, "wb", buffering=0) as filler:
            while True:
                try:
                    written += filler.write(chunk)
                except OSError as error:
                    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    chunk = chunk[: len(chunk) // 2]
                    if not chunk:
                        return written

    def unmount(self) -> None:
        """Stop, and put the log back on the real disk (copied out of the tmpfs, which goes)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self.mounted:
            return
        (self.log_dir / self.FILLER).unlink(missing_ok=True)
        saved = self.log_dir.parent / f"{self.log_dir.name}.tmpfs-copy"
        shutil.copytree(self.log_dir, saved)
        subprocess.run(["umount", str(self.log_dir)], check=True, capture_output=True)
        self.mounted = False
        shutil.rmtree(self.log_dir)
        saved.rename(self.log_dir)


# -- the run's config -------------------------------------------------------------------------------------------


def run_config(run_dir: Path, *, steps: int, seed: int, base: Path = BASE_CONFIG) -> dict:
    """examples/cluster-cpu.toml with the run's directory, steps and seed, paths absolute, and a lost cell
    noticed within seconds (the chaos kills one every few)."""
    data = tomllib.loads(base.read_text())
    data.update(name="chaos", run_dir=str(run_dir), steps=steps, seed=seed)
    for key in ("tasks", "harness"):
        path = Path(data["rollout"][key])
        data["rollout"][key] = str(path if path.is_absolute() else ROOT / path)
    cluster = data.setdefault("cluster", {})
    cluster.setdefault("heartbeat_s", 0.5)
    cluster.setdefault("dead_after_s", 5.0)
    return data


def write_config(run_dir: Path, data: dict) -> Path:
    """The config as JSON (`ClusterConfig.load` reads the JSON it writes), validated first."""
    from gyre.cluster.config import ClusterConfig

    config = ClusterConfig.model_validate(data)
    path = run_dir.parent / f"{run_dir.name}-config.json"
    path.write_text(config.model_dump_json(indent=2))
    return path


# -- the driver (needs `gyre run --resume` and the pid files: see the module doc) ------------------------------


@dataclass
class KillRecord:
    n: int
    at_s: float
    ts: str
    victim_class: str
    victim: str
    pid: int
    log_seq: int
    recovery_s: float | None = None
    """Kill to the next reward_recorded / train_step_finished in the log."""
    restart_s: float | None = None
    """A controller kill: until a peer's event reached the resumed controller."""
    burst: str = ""
    """The burst the kill was part of (`BURSTS`), or "" for a single kill."""
    in_train_step: int | None = None
    """The train step open in the log (started, neither finished nor aborted) when the kill landed."""


@dataclass
class ChaosResult:
    kills: list[KillRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    controller_starts: int = 0
    wall_s: float = 0.0
    bursts: dict[str, int] = field(default_factory=dict)
    finished: bool = False


def _last_seq(log: Path) -> int:
    from gyre.errors import GyreError
    from gyre.log import LogReader

    try:
        return LogReader(log).last_seq()
    except (GyreError, OSError):
        return -1


def _peer_event_after(log: Path, seq: int) -> bool:
    """Whether an event from a producer other than the controller was logged after ``seq``."""
    from gyre.log import LogReader

    if _last_seq(log) <= seq:
        return False
    (n,) = LogReader(log).duckdb().execute(
        "SELECT count(*) FROM events WHERE seq > ? AND producer IS NOT NULL AND producer <> 'controller'",
        [seq]).fetchone()
    return n > 0


class Chaos:
    def __init__(self, run_dir: Path, config: Path, schedule: KillSchedule, kills: int, *,
                 timeout_s: float = 1800, stall_s: float = 120, output: Path | None = None,
                 run_args: tuple[str, ...] = ()) -> None:
        """``run_args``: more of `gyre run`'s options, on every start (``--emulate ...``)."""
        self.run_dir, self.config, self.schedule, self.target = run_dir, config, schedule, kills
        self.run_args = run_args
        self.log = run_dir / "log"
        self.timeout_s, self.stall_s = timeout_s, stall_s
        self.output = output or run_dir.parent / f"{run_dir.name}-controller.log"
        self.controller: subprocess.Popen | None = None
        self.result = ChaosResult()
        self._started = time.monotonic()

    def start_controller(self, resume: bool) -> None:
        argv = [sys.executable, "-m", "gyre", "run", str(self.config), *self.run_args,
                *(["--resume"] if resume else [])]
        with open(self.output, "ab") as out:
            self.controller = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               cwd=ROOT)
        self.result.controller_starts += 1

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def _controller_exit(self) -> int | None:
        return self.controller.poll() if self.controller is not None else None

    def _wait_for(self, seconds: float, events: int) -> bool:
        """Let the run go until ``seconds`` passed and the log grew by ``events``; False when the run ended
        (or stalled, a problem recorded) first."""
        start_seq, start, last_change, last_seq = _last_seq(self.log), time.monotonic(), time.monotonic(), None
        while True:
            if self._controller_exit() is not None:
                return False
            seq = _last_seq(self.log)
            if seq != last_seq:
                last_seq, last_change = seq, time.monotonic()
            if time.monotonic() - start >= seconds and seq - start_seq >= events:
                return True
            if time.monotonic() - last_change > self.stall_s:
                self.result.problems.append(f"the log did not grow for {self.stall_s:.0f}s (at seq {seq}, "
                                            f"{len(self.result.kills)} kills done)")
                return False
            if self.elapsed() > self.timeout_s:
                self.result.problems.append(f"the run went past --timeout-s {self.timeout_s:.0f}")
                return False
            time.sleep(0.2)

    def _settle_controller(self, since_seq: int) -> float | None:
        """After a controller restart: seconds until a peer's event reached it (None: the run ended or stalled)."""
        start = time.monotonic()
        while time.monotonic() - start < self.stall_s:
            if self._controller_exit() is not None:
                return None
            if _peer_event_after(self.log, since_seq):
                return time.monotonic() - start
            time.sleep(0.25)
        self.result.problems.append(f"no peer reached the resumed controller within {self.stall_s:.0f}s")
        return None

    def run(self) -> ChaosResult:
        self.start_controller(resume=False)
        try:
            self._kill_loop()
            self._finish()
        finally:
            self._cleanup()
        self.result.wall_s = self.elapsed()
        return self.result

    def _kill_loop(self) -> None:
        while len(self.result.kills) < self.target and not self.result.problems:
            seconds, events = self.schedule.wait()
            if not self._wait_for(seconds, events):
                return
            controller_pid = self.controller.pid if self.controller else None
            live = candidates(self.run_dir, controller_pid)
            burst = self.schedule.burst(live)
            if burst is not None:
                kind, victims = burst
                self.result.bursts[kind] = self.result.bursts.get(kind, 0) + 1
            else:
                drawn = self.schedule.victim(live)
                if drawn is None:
                    continue
                kind, victims = "", [drawn]
            for i, (victim_class, name) in enumerate(victims[:self.target - len(self.result.kills)]):
                if i:
                    time.sleep(self.schedule.burst_gap())
                self._kill(victim_class, name, controller_pid, kind)

    def _kill(self, victim_class: str, name: str, controller_pid: int | None, burst: str) -> None:
        pid = resolve(name, self.run_dir, controller_pid)
        seq = _last_seq(self.log)
        if pid is None or not kill(name, pid):
            return
        record = KillRecord(n=len(self.result.kills) + 1, at_s=round(self.elapsed(), 3),
                            ts=datetime.now(UTC).isoformat(), victim_class=victim_class, victim=name, pid=pid,
                            log_seq=seq, burst=burst)
        self.result.kills.append(record)
        if victim_class == "controller":
            self.controller.wait()
            self.start_controller(resume=True)
            settled = self._settle_controller(_last_seq(self.log))
            record.restart_s = None if settled is None else round(settled, 3)

    def _finish(self) -> None:
        if self.result.problems or self.controller is None:
            return
        try:
            code = self.controller.wait(timeout=max(1.0, self.timeout_s - self.elapsed()))
        except subprocess.TimeoutExpired:
            self.result.problems.append(f"the run went past --timeout-s {self.timeout_s:.0f}")
            return
        if code != 0:
            self.result.problems.append(f"gyre run exited {code} (output in {self.output})")
            return
        self.result.finished = True
        if len(self.result.kills) < self.target:
            self.result.problems.append(f"the run finished after {len(self.result.kills)} of {self.target} kills: "
                                        f"give it more --steps")

    def _cleanup(self) -> None:
        """Whatever of this run still lives (a failed run): the controller, then the pids its files name."""
        if self.controller is not None and self.controller.poll() is None:
            self.controller.kill()
            self.controller.wait()
        for name, pid in pid_files(self.run_dir).items():
            if name != "controller" and running(pid) and _is_ours(pid, self.run_dir):
                kill(name, pid)


def _is_ours(pid: int, run_dir: Path) -> bool:
    """A pid from our pid files still runs `gyre` for this run (not a recycled pid)."""
    line = " ".join(cmdline(pid))
    return "gyre" in line and (str(run_dir) in line or "--controller" in line)


# -- figures ------------------------------------------------------------------------------------------------------


def recovery_times(log: Path, kills: list[KillRecord]) -> float | None:
    """Fill each kill's ``recovery_s`` from the log; returns the median gap between progress events."""
    from gyre.log import LogReader

    kinds = ", ".join(f"'{k}'" for k in PROGRESS_KINDS)
    times = [ts for (ts,) in LogReader(log).duckdb().execute(
        f"SELECT ts FROM events WHERE kind IN ({kinds}) ORDER BY ts").fetchall()]
    for record in kills:
        at = datetime.fromisoformat(record.ts)
        after = next((t for t in times if t > at), None)
        record.recovery_s = None if after is None else round((after - at).total_seconds(), 3)
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(times)]
    return round(statistics.median(gaps), 3) if gaps else None


def kills_in_train_steps(log: Path, kills: list[KillRecord]) -> None:
    """Fill each kill's ``in_train_step``: the step the log shows open (started, not yet finished or aborted)
    at the kill's moment."""
    from gyre.log import LogReader

    rows = LogReader(log).duckdb().execute(
        "SELECT kind, step, ts FROM events WHERE kind IN ('train_step_started', 'train_step_finished', "
        "'train_step_aborted') ORDER BY seq").fetchall()
    for record in kills:
        at, open_step = datetime.fromisoformat(record.ts), None
        for kind, step, ts in rows:
            if ts > at:
                break
            open_step = step if kind == "train_step_started" else None
        record.in_train_step = open_step


def summary(result: ChaosResult, audit, replay: dict | None, baseline_gap_s: float | None) -> dict:
    by_class = dict.fromkeys(VICTIM_CLASSES, 0)
    for record in result.kills:
        by_class[record.victim_class] += 1
    recovery = [r.recovery_s for r in result.kills if r.recovery_s is not None]
    restarts = [r.restart_s for r in result.kills if r.restart_s is not None]
    problems = list(result.problems)
    in_steps = dict.fromkeys(VICTIM_CLASSES, 0)
    for record in result.kills:
        in_steps[record.victim_class] += record.in_train_step is not None
    out = {"kills": len(result.kills), "kills_by_victim": by_class, "bursts": dict(result.bursts),
           "kills_in_train_steps": sum(in_steps.values()), "kills_in_train_steps_by_victim": in_steps,
           "finished": result.finished,
           "wall_s": round(result.wall_s, 1), "controller_starts": result.controller_starts,
           "time_lost_per_kill_s": {"median": round(statistics.median(recovery), 3) if recovery else None,
                                    "max": max(recovery) if recovery else None,
                                    "unrecovered": len(result.kills) - len(recovery)},
           "progress_gap_median_s": baseline_gap_s,
           "controller_restart_s": {"median": round(statistics.median(restarts), 3) if restarts else None,
                                    "max": max(restarts) if restarts else None}}
    if audit is not None:
        out.update(completions=audit.completions, executions=audit.executions, requeued=audit.requeued,
                   rewards=audit.rewards, evaluation_failures=audit.evaluation_failures,
                   harness_errors=audit.harness_errors, events_lost=audit.events_lost,
                   events_doubled=audit.events_doubled,
                   rewards_lost=audit.rewards_lost, rewards_doubled=audit.rewards_doubled,
                   micro_steps_redone=audit.micro_steps_redone, micro_steps_released=audit.micro_steps_released,
                   steps_trained=audit.steps_trained, steps_aborted=audit.steps_aborted,
                   role_switches=audit.role_switches, cells_lost=audit.cells_lost,
                   cells_reregistered=audit.cells_reregistered, spill_files=audit.spill_files,
                   commands_abandoned=audit.commands_abandoned)
        problems += audit.problems
    if replay is not None:
        out["replay_mismatches"] = replay.get("mismatches")
        if replay.get("mismatches") or replay.get("error"):
            problems.append(f"replay: {replay.get('error') or str(replay['mismatches']) + ' mismatches'}")
    out["problems"] = problems
    out["passed"] = not problems and result.finished
    out["kill_log"] = [asdict(r) for r in result.kills]
    return out


def replay(log: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "gyre", "replay", str(log), "--json"], capture_output=True,
                          text=True, cwd=ROOT)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"gyre replay exited {done.returncode}: {done.stderr.strip()[-500:]}"}


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: ``1-10``, ``3,5,7`` or a mix (``1-3,8``), in the order given."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        first, _, last = part.partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"--seeds: {part!r} is not a seed or a range like 1-10") from None
        if high < low:
            raise ValueError(f"--seeds: the range {part!r} is empty")
        seeds += range(low, high + 1)
    if not seeds:
        raise ValueError("--seeds: no seeds given")
    return seeds


def totals(runs: list[dict]) -> dict:
    """The seeds' runs summed: runs completed, kills by class, what was lost or doubled, time lost per kill
    (over every kill of every run), replay mismatches."""
    def total(key: str) -> int:
        return sum(r.get(key) or 0 for r in runs)

    by_class = dict.fromkeys(VICTIM_CLASSES, 0)
    bursts: dict[str, int] = {}
    for r in runs:
        for victim, count in r["kills_by_victim"].items():
            by_class[victim] += count
        for kind, count in r.get("bursts", {}).items():
            bursts[kind] = bursts.get(kind, 0) + count
    recovery = [k["recovery_s"] for r in runs for k in r["kill_log"] if k.get("recovery_s") is not None]
    return {"runs": len(runs), "runs_completed": sum(bool(r["finished"]) for r in runs),
            "runs_passed": sum(bool(r["passed"]) for r in runs),
            "failed_seeds": [r["seed"] for r in runs if not r["passed"]],
            "kills": total("kills"), "kills_by_victim": by_class, "bursts": bursts,
            "kills_in_train_steps": total("kills_in_train_steps"),
            "events_lost": total("events_lost"), "events_doubled": total("events_doubled"),
            "rewards_lost": total("rewards_lost"), "rewards_doubled": total("rewards_doubled"),
            "commands_abandoned": total("commands_abandoned"),
            "time_lost_per_kill_s": {"median": round(statistics.median(recovery), 3) if recovery else None,
                                     "max": max(recovery) if recovery else None,
                                     "unrecovered": total("kills") - len(recovery)},
            "replay_mismatches": total("replay_mismatches"), "wall_s": round(sum(r["wall_s"] for r in runs), 1)}


def run_seed(args: argparse.Namespace, seed: int, root: Path, run_name: str = "run") -> dict:
    """One chaos run of ``seed`` under ``root``; its summary (``kill_log`` included)."""
    steps = args.steps or max(4, (args.kills + 1) // 2)
    pace = Pace(args.min_wait_s, args.max_wait_s, min(1, args.max_events), args.max_events)
    schedule = KillSchedule(seed, args.weights, pace, burst_share=args.bursts)
    run_dir = root / run_name
    config = write_config(run_dir, run_config(run_dir, steps=steps, seed=seed, base=args.config))
    emulate = ("--emulate", args.emulate, "--time-scale", str(args.time_scale), "--token-scale",
               str(args.token_scale), "--steps", str(steps)) if args.emulate else ()
    chaos = Chaos(run_dir, config, schedule, args.kills, timeout_s=args.timeout_s, stall_s=args.stall_s,
                  run_args=emulate)
    disk = FullDisk(run_dir / "log", args.full_disk_at_s, args.full_disk_s) if args.full_disk_s else None
    try:
        if disk is not None:
            disk.mount()
            disk.start(chaos.elapsed)
        result = chaos.run()
    finally:
        if disk is not None:
            disk.unmount()
    report = replayed = gap = None
    if (run_dir / "log").is_dir() and any((run_dir / "log").glob("*.seg")):
        from gyre.audit import audit

        report = audit(run_dir / "log", expected_steps=steps, require_finished=True)
        gap = recovery_times(run_dir / "log", result.kills)
        kills_in_train_steps(run_dir / "log", result.kills)
        replayed = replay(run_dir / "log")
    out = {"seed": seed, "steps": steps, **summary(result, report, replayed, gap)}
    if disk is not None:
        out["full_disk"] = disk.figures
        if "freed_at_s" not in disk.figures:
            out["problems"].append("the run ended before the full disk was given back: start it earlier")
            out["passed"] = False
    if args.keep is not None:
        out["run_dir"] = str(run_dir)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", type=parse_seeds, default=None,
                        help="several runs in sequence, e.g. 1-10 or 3,5,7: each seed's figures and their totals")
    parser.add_argument("--steps", type=int, default=None, help="train steps (default: enough for the kills)")
    parser.add_argument("--weights", type=parse_weights, default=None,
                        help="victim class weights, e.g. controller=1,proxy=1,cell=2,harness=2")
    parser.add_argument("--bursts", type=float, default=0.0,
                        help="share of kill moments that are bursts: every cell, core+controller, proxy+core")
    parser.add_argument("--full-disk-s", type=float, default=0.0,
                        help="fill the log's disk (a tmpfs; root) for this long, --full-disk-at-s into the run")
    parser.add_argument("--full-disk-at-s", type=float, default=60.0)
    parser.add_argument("--partitions", action="store_true",
                        help="no kills: a run on three network-namespace hosts (root, iproute2, nftables), partitioned "
                             "controller<->cell and cell<->cell (benchmarks/chaos_partition.py)")
    parser.add_argument("--partition-s", type=float, default=30.0, help="how long each partition holds")
    parser.add_argument("--link-loss-pct", type=float, default=1.0, help="--partitions: packets every link loses")
    parser.add_argument("--link-delay-ms", type=float, default=5.0,
                        help="--partitions: tc netem delay on every link (where the kernel has sch_netem)")
    parser.add_argument("--emulate", default=None, metavar="SCENARIO",
                        help="cells on SCENARIO's emulated accelerator (`gyre run --emulate`): train steps take "
                             "its training time, so kills land inside them (counted: kills_in_train_steps)")
    parser.add_argument("--time-scale", type=float, default=10.0, help="with --emulate")
    parser.add_argument("--token-scale", type=float, default=100.0, help="with --emulate")
    parser.add_argument("--min-wait-s", type=float, default=1.0)
    parser.add_argument("--max-wait-s", type=float, default=6.0)
    parser.add_argument("--max-events", type=int, default=20,
                        help="new log events to wait for, drawn 1..this; 0: time alone paces the kills (a train "
                             "step logs little while it runs: waiting for events kept kills out of it)")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--stall-s", type=float, default=120, help="a log that does not grow this long fails")
    parser.add_argument("--config", type=Path, default=BASE_CONFIG, help="base cluster config (TOML)")
    parser.add_argument("--keep", type=Path, default=None, help="run here and keep it (default: a temp dir)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="gyre-chaos-")) if args.keep is None else args.keep
    root.mkdir(parents=True, exist_ok=True)
    try:
        if args.partitions:
            from benchmarks.chaos_partition import run_partitions

            out = run_partitions(root / f"partitions-s{args.seed}", steps=args.steps or 12, seed=args.seed,
                                 hold_s=args.partition_s, loss_pct=args.link_loss_pct,
                                 delay_ms=args.link_delay_ms, timeout_s=args.timeout_s,
                                 base=args.config)
        elif args.seeds is None:
            out = run_seed(args, args.seed, root)
        else:
            runs = []
            for seed in args.seeds:
                runs.append(run_seed(args, seed, root, f"run-s{seed}"))
                if not args.json:
                    print(json.dumps({k: v for k, v in runs[-1].items() if k != "kill_log"}), flush=True)
            out = {"seeds": args.seeds, "runs": runs, "total": totals(runs),
                   "passed": all(r["passed"] for r in runs)}
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    elif args.seeds is None or args.partitions:
        print(json.dumps({k: v for k, v in out.items() if k != "kill_log"}, indent=2))
    else:
        print(json.dumps(out["total"], indent=2))
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
