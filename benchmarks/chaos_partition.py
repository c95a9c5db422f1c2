"""Network partitions: a 4-cell run over three network-namespace hosts, netem delay and loss on every link,
and two partitions of ``hold_s`` seconds each.

    python -m benchmarks.chaos_bench --partitions --partition-s 30 --seed 1 --json     # root, iproute2, nftables

Host a runs the controller and the proxy (with the harnesses), host b the core (cell0) and cell1, host c cell2
and cell3 (`tests/cluster/hosts.py`: a network namespace and a private disk each; ``launcher = "manual"``).
Every process that exits is started again on its host, as systemd or an ``srun`` loop would. Every link loses
``loss_pct`` of its packets (nftables ``numgen``) for the whole run, and is delayed by ``tc netem`` where the
kernel has it (this VM's does not: the figures say so); a partition drops every IP packet between two hosts,
both ways (an nftables set on each), and heals by emptying it:

1. **controller <-> cell**: a and c, from the first finished train step. The controller declares c's cells
   lost (missed heartbeats); once the partition heals their streams come back as the old incarnation, are
   refused (a lost process never comes back), and the processes exit; started again, new incarnations
   register. A cut-off cell never acts beside its replacement: the hub refuses its commands and events.
2. **cell <-> cell mid-transfer**: b (the core) and c, from the first ``train_step_started`` after c's cells
   are back (a tiny model's pull takes milliseconds: cut at a publish, it was over before the cut). The step
   publishes while the partition holds: the engines on c must pull that version from the core over Mooncake
   across the cut (their loads fail and are retried until it heals), and satellites on c join or leave the
   core's step across it. ``loads_across_cut``: the loads of versions published during the cut, with the
   seconds each took (retries included).

The run must complete, its log audit clean (`gyre.audit`) and its replay exact (`gyre replay`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.chaos_bench import run_config, write_config
from gyre import auth
from gyre.cluster.auth import SECRET_ENV
from gyre.cluster.run import process_argv
from tests.cluster.hosts import Hosts, available

HOSTS = {"a": ("controller", "proxy"), "b": ("cell0", "cell1"), "c": ("cell2", "cell3")}
PORT = 7700


def unavailable() -> str | None:
    """None when partitions can be made here; else why not (root, iproute2, nftables)."""
    why = available()
    if why is None and shutil.which("nft") is None:
        why = "nft is not installed (nftables)"
    return why


TABLE = """
table inet gyre {
  set cut { type ipv4_addr; }
  chain out { type filter hook output priority 0; policy accept; ip daddr @cut drop; %(loss)s }
  chain in { type filter hook input priority 0; policy accept; ip saddr @cut drop; }
}
"""
"""Each host's firewall: packets to or from a host in ``cut`` are dropped (a partition, made and healed by
adding and removing the element); every packet sent is lost with the link's probability (``numgen``)."""


class Links:
    """Loss (and delay, where the kernel has ``sch_netem``) on every link of ``hosts``; partitions between two
    hosts, made and healed. Delay needs netem; loss and partitions only netfilter, which every kernel with
    network namespaces here has."""

    def __init__(self, hosts: Hosts, loss_pct: float, delay_ms: float) -> None:
        self.hosts, self.loss_pct, self.delay_ms = hosts, loss_pct, delay_ms
        self.delay: str = "none"

    def _nft(self, netns: str, *args: str, stdin: str | None = None) -> None:
        subprocess.run(["ip", "netns", "exec", netns, "nft", *args], input=stdin, check=True, capture_output=True,
                       text=True)

    def shape(self) -> None:
        per_mille = round(self.loss_pct * 10)
        loss = f"numgen random mod 1000 < {per_mille} drop;" if per_mille else ""
        for host in self.hosts.hosts.values():
            self._nft(host.netns, "-f", "-", stdin=TABLE % {"loss": loss})
        if self.delay_ms:
            self.delay = self._netem_delay()

    def _netem_delay(self) -> str:
        """netem delay on every switch port; what was done, or why not."""
        for i in range(len(self.hosts.hosts)):
            done = subprocess.run(["ip", "netns", "exec", self.hosts.switch, "tc", "qdisc", "add", "dev",
                                   f"{self.hosts.tag}s{i}", "root", "netem", "delay", f"{self.delay_ms}ms"],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                return f"unavailable: tc netem failed ({done.stderr.strip()}; the kernel lacks sch_netem?)"
        return f"{self.delay_ms} ms each way"

    def _elements(self, a: str, b: str, verb: str) -> None:
        for here, there in ((a, b), (b, a)):
            self._nft(self.hosts[here].netns, verb, "element", "inet", "gyre", "cut",
                      f"{{ {self.hosts[there].address} }}")

    def cut(self, a: str, b: str) -> None:
        self._elements(a, b, "add")

    def heal(self, a: str, b: str) -> None:
        self._elements(a, b, "delete")


@dataclass
class Partition:
    between: tuple[str, str]
    what: str
    at_s: float = 0.0
    healed_at_s: float = 0.0
    ts: str = ""
    healed_ts: str = ""
    trigger_seq: int = -1


@dataclass
class PartitionResult:
    partitions: list[Partition] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    finished: bool = False
    wall_s: float = 0.0


class PartitionRun:
    """One run on the three hosts, partitioned twice; the bench's ``--partitions``."""

    def __init__(self, tmp: Path, *, steps: int, seed: int, hold_s: float, loss_pct: float, delay_ms: float,
                 timeout_s: float, base: Path) -> None:
        self.tmp, self.steps, self.seed, self.hold_s = tmp, steps, seed, hold_s
        self.loss_pct, self.delay_ms = loss_pct, delay_ms
        self.delay = "none"
        self.timeout_s, self.base = timeout_s, base
        self.result = PartitionResult()
        self._started = time.monotonic()
        self._stop = threading.Event()

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def _config(self, hosts: Hosts, name: str) -> None:
        run_dir = hosts.root / "run"  # the same path on every host, a different disk behind it
        data = run_config(run_dir, steps=self.steps, seed=self.seed, base=self.base)
        data["cluster"].update(bind="0.0.0.0", port=PORT, launcher="manual",
                               **({"advertise": hosts["a"].address} if name == "a" else {}))
        written = write_config(hosts[name].disk / "run", data)
        written.rename(hosts[name].disk / "run.json")

    def run(self) -> tuple[PartitionResult, Path]:
        env = {**os.environ, SECRET_ENV: auth.mint(auth.RUN_PREFIX), "PYTHONPATH": str(Path(__file__).parents[1])}
        with Hosts(self.tmp, list(HOSTS)) as hosts:
            for name in HOSTS:
                self._config(hosts, name)
            links = Links(hosts, self.loss_pct, self.delay_ms)
            links.shape()
            self.delay = links.delay
            config = str(hosts.root / "run.json")
            controller_address = f"{hosts['a'].address}:{PORT}"
            controller = hosts.spawn("a", [sys.executable, "-m", "gyre", "run", config], env=env,
                                     log="controller.out")
            argv = {p: process_argv(p, controller_address, config) for ps in HOSTS.values() for p in ps
                    if p != "controller"}
            procs = {p: hosts.spawn(h, argv[p], env=env, log=f"{p}.out") for h, ps in HOSTS.items() for p in ps
                     if p != "controller"}
            keeper = threading.Thread(target=self._keep_alive, args=(hosts, procs, argv, env, controller),
                                      daemon=True)
            keeper.start()
            log = hosts["a"].disk / "run" / "log"
            try:
                self._partitions(links, log, controller)
                if not self.result.problems:
                    self._finish(controller, hosts)
            finally:
                self._stop.set()
                keeper.join()
        self.result.wall_s = self.elapsed()
        return self.result, log

    def _keep_alive(self, hosts: Hosts, procs: dict[str, subprocess.Popen], argv: dict[str, list[str]],
                    env: dict[str, str], controller: subprocess.Popen) -> None:
        """An exited cell or proxy is started again on its host while the run goes on."""
        host_of = {p: h for h, ps in HOSTS.items() for p in ps}
        while not self._stop.wait(0.5) and controller.poll() is None:
            for name, proc in list(procs.items()):
                if proc.poll() is not None and controller.poll() is None:
                    self.result.restarts[name] = self.result.restarts.get(name, 0) + 1
                    procs[name] = hosts.spawn(host_of[name], argv[name], env=env, log=f"{name}.out")

    def _wait(self, log: Path, controller: subprocess.Popen, what: str, ready) -> int | None:
        """Poll the log until ``ready(reader, since_seq)`` names a seq; None (a problem recorded) when the run
        ended or timed out first."""
        from gyre.log import LogReader

        while self.elapsed() < self.timeout_s:
            if controller.poll() is not None:
                self.result.problems.append(f"the run ended (exit {controller.returncode}) before {what}: "
                                            "give it more --steps")
                return None
            if any(log.glob("*.seg")):
                seq = ready(LogReader(log))
                if seq is not None:
                    return seq
            time.sleep(0.1)
        self.result.problems.append(f"no {what} within --timeout-s {self.timeout_s:.0f}")
        return None

    def _hold(self, links: Links, between: tuple[str, str], what: str, seq: int) -> None:
        partition = Partition(between, what, at_s=round(self.elapsed(), 3), ts=datetime.now(UTC).isoformat(),
                              trigger_seq=seq)
        links.cut(*between)
        self.result.partitions.append(partition)
        self._stop.wait(self.hold_s)
        links.heal(*between)
        partition.healed_at_s, partition.healed_ts = round(self.elapsed(), 3), datetime.now(UTC).isoformat()

    def _partitions(self, links: Links, log: Path, controller: subprocess.Popen) -> None:
        def first(kind: str, after: int = -1, cells: tuple[str, ...] = ()):
            where = f" AND cell_id IN ({', '.join(repr(c) for c in cells)})" if cells else ""
            return lambda reader: reader.duckdb().execute(
                f"SELECT min(seq) FROM events WHERE kind = '{kind}' AND seq > {after}{where}").fetchone()[0]

        seq = self._wait(log, controller, "a finished train step", first("train_step_finished"))
        if seq is None:
            return
        self._hold(links, ("a", "c"), "controller <-> cells 2, 3", seq)
        cut_seq = seq

        def back(reader):  # both cells of c registered again after they were lost
            rows = reader.duckdb().execute(
                "SELECT cell_id, max(seq) FILTER (WHERE kind = 'cell_lost'), max(seq) FILTER (WHERE kind = "
                f"'cell_registered') FROM events WHERE seq > {cut_seq} AND cell_id IN ('cell2', 'cell3') "
                "GROUP BY cell_id").fetchall()
            done = [r for r in rows if r[2] is not None and (r[1] is None or r[2] > r[1])]
            return max(r[2] for r in done) if len(done) == 2 else None

        seq = self._wait(log, controller, "cells 2 and 3 registered again", back)
        if seq is None:
            return
        seq = self._wait(log, controller, "a train step started after cells 2 and 3 came back",
                         first("train_step_started", after=seq))
        if seq is None:
            return
        self._hold(links, ("b", "c"), "core's host <-> cells 2, 3 (weights)", seq)

    def _finish(self, controller: subprocess.Popen, hosts: Hosts) -> None:
        try:
            code = controller.wait(timeout=max(1.0, self.timeout_s - self.elapsed()))
        except subprocess.TimeoutExpired:
            self.result.problems.append(f"the run went past --timeout-s {self.timeout_s:.0f}")
            return
        if code != 0:
            tail = (hosts["a"].disk / "controller.out").read_text(errors="replace")[-1500:]
            self.result.problems.append(f"gyre run exited {code}: {tail}")
            return
        self.result.finished = True


def figures(result: PartitionResult, log: Path, steps: int) -> dict:
    """What the partitions did, from the log: cells lost and registered again per partition, commands given
    up on, transfers the cells on c completed while cut off; then the audit and the replay."""
    from benchmarks.chaos_bench import replay
    from gyre.audit import audit
    from gyre.log import LogReader

    out: dict = {"finished": result.finished, "wall_s": round(result.wall_s, 1), "restarts": result.restarts,
                 "partitions": []}
    problems = list(result.problems)
    if not any(log.glob("*.seg")):
        return {**out, "problems": [*problems, "no log"], "passed": False}
    con = LogReader(log).duckdb()
    for p in result.partitions:
        window = "ts >= CAST(? AS TIMESTAMPTZ) AND ts < CAST(? AS TIMESTAMPTZ)"
        counts = dict(con.execute(
            f"SELECT kind, count(*) FROM events WHERE {window} AND cell_id IN ('cell2', 'cell3') GROUP BY kind",
            [p.ts, p.healed_ts]).fetchall())
        abandoned = con.execute(f"SELECT command, count(*) FROM commands_abandoned WHERE "
                                f"{window} GROUP BY command", [p.ts, p.healed_ts]).fetchall()
        across = con.execute(
            "SELECT l.cell_id, l.policy_version, round(l.duration_s, 3) FROM weights_loaded l JOIN weights_published "
            "p USING (policy_version) WHERE l.cell_id IN ('cell2', 'cell3') AND p.ts >= CAST(? AS TIMESTAMPTZ) AND "
            "p.ts < CAST(? AS TIMESTAMPTZ) ORDER BY l.seq", [p.ts, p.healed_ts]).fetchall()
        out["partitions"].append({
            "between": "-".join(p.between), "what": p.what, "at_s": p.at_s,
            "held_s": round(p.healed_at_s - p.at_s, 3), "cells_lost": counts.get("cell_lost", 0),
            "cells_registered": counts.get("cell_registered", 0),
            "weights_loaded_on_c": counts.get("weights_loaded", 0),
            "micro_steps_on_c": counts.get("micro_step_finished", 0),
            "commands_abandoned": dict(abandoned), "loads_across_cut": [list(row) for row in across],
            "from": p.ts, "to": p.healed_ts})
    output = log.parents[1] / "controller.out"
    text = output.read_text(errors="replace") if output.exists() else ""
    # pulls over Mooncake that failed (and were retried): here only a cut between hosts makes one fail
    out["transfers_failed"] = text.count("TransferError: Mooncake read with")
    report = audit(log, expected_steps=steps, require_finished=True)
    replayed = replay(log)
    out.update(steps_trained=report.steps_trained, events_lost=report.events_lost,
               events_doubled=report.events_doubled, rewards_lost=report.rewards_lost,
               rewards_doubled=report.rewards_doubled, cells_lost=report.cells_lost,
               cells_reregistered=report.cells_reregistered, commands_abandoned=report.commands_abandoned,
               replay_mismatches=replayed.get("mismatches"))
    problems += report.problems
    if replayed.get("mismatches") or replayed.get("error"):
        problems.append(f"replay: {replayed.get('error') or str(replayed['mismatches']) + ' mismatches'}")
    out["problems"] = problems
    out["passed"] = not problems and result.finished
    return out


def run_partitions(tmp: Path, *, steps: int, seed: int, hold_s: float, loss_pct: float, delay_ms: float,
                   timeout_s: float, base: Path) -> dict:
    """The partition run under ``tmp`` and its figures; a clear error when this machine cannot make hosts."""
    why = unavailable()
    if why is not None:
        raise SystemExit(f"--partitions needs root and iproute2 (network namespaces, tc): {why}")
    run = PartitionRun(tmp, steps=steps, seed=seed, hold_s=hold_s, loss_pct=loss_pct, delay_ms=delay_ms,
                       timeout_s=timeout_s, base=base)
    result, log = run.run()
    return {"seed": seed, "steps": steps, "hold_s": hold_s, "link_loss_pct": loss_pct, "link_delay": run.delay,
            **figures(result, log, steps)}
