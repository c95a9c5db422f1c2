"""The 4-cell elastic demo across three hosts (network namespaces, each with its own disk), cells started by
hand (`launcher = "manual"`); one host is cut mid-run and the run still finishes, audited and replayed.

Host a: the controller and the proxy (with the harnesses). Host b: cell0 (the core) and cell1. Host c: cell2 and
cell3. Every process binds 0.0.0.0; the controller advertises 10.77.0.1 (its config says so), each cell
advertises the address the kernel routes toward the controller (its config says nothing). No process can read
another host's files: the core reads the log through the controller, engines pull weights from the core over
Mooncake, KV moves engine to engine (checked first on its own, between engines on b and c: a run's redirects
depend on timing). Once a cell on c holds weights pulled from b, host c loses its link and then its
processes; the controller declares its cells lost (missed heartbeats) and finishes with cells 0 and 1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from gyre import auth
from gyre.audit.rules import audit
from gyre.cluster.auth import SECRET_ENV
from gyre.cluster.config import ClusterConfig, RaySection
from gyre.cluster.run import process_argv
from gyre.events.models import CellLost, CellRegistered, RunFinished
from gyre.log import LogReader
from gyre.replay.exact import replay_decisions
from tests.cluster.hosts import Hosts, available
from tests.conftest import HANG_S

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]
PORT = 7700
STEPS = 2
RAY_STEPS = 3
"""The Ray run's host is cut once weights have crossed to it, which can be late in step 1: with two steps the run
could finish before the cut host's cells were declared lost (``dead_after_s``), as it did on a fast machine. A
third step gives them work that cannot finish without their loss being noticed."""
HOSTS = {"a": ("controller", "proxy"), "b": ("cell0", "cell1"), "c": ("cell2", "cell3")}


def _config(run_dir: Path, steps: int = STEPS, **cluster: object) -> ClusterConfig:
    base = ClusterConfig.load(REPO / "examples" / "cluster-cpu.toml")
    settings = {"bind": "0.0.0.0", "port": PORT, "launcher": "manual", "heartbeat_s": 0.5, "dead_after_s": 4.0,
                "lease_s": 4.0, "slots": 4, **cluster}  # 4 slots: a cell still serving is lent (its calls move)
    return base.model_copy(update={"run_dir": run_dir, "steps": steps,
                                   "cluster": base.cluster.model_copy(update=settings)})


CROSSED = "SELECT count(*) FROM events WHERE cell_id IN ({cells}) AND (kind = 'micro_step_finished' " \
          "OR (kind = 'weights_loaded' AND weights_loaded.weights_bytes > 0))"
"""Facts that prove weights crossed hosts: a satellite on c computes a micro-step only on weights it pulled from
the core on b over Mooncake (and the core counts it once the gradients are in its slot); an engine on c loads
a published version by pulling it from the core the same way (c's disk has no weights file to fall back on)."""


def _crossed(log: Path, cells: set[str]) -> int:
    """How many facts prove weights crossed to ``cells`` (on a host other than the core's)."""
    return LogReader(log).duckdb().execute(CROSSED.format(cells=", ".join(f"'{c}'" for c in sorted(cells)))
                                           ).fetchone()[0]


def _wait_until_weights_crossed(log: Path, controller: subprocess.Popen, deadline: float, cells: set[str]) -> None:
    """Until the controller's log (read from host a's disk, outside) shows a cell on host c holding weights it
    pulled from another host: then host c is cut."""
    while time.monotonic() < deadline:
        assert controller.poll() is None, "the controller exited before weights crossed hosts"
        if any(log.glob("*.seg")) and _crossed(log, cells) > 0:
            return
        time.sleep(0.2)
    raise AssertionError("no cell on host c pulled weights from the core on host b in time")


def _placement(log: Path, controller: subprocess.Popen, deadline: float) -> dict[str, str]:
    """cell -> the host its first incarnation registered from, once every cell has registered."""
    by_address = {f"http://10.77.0.{i + 1}:": name for i, name in enumerate(HOSTS)}
    while time.monotonic() < deadline:
        assert controller.poll() is None, "the controller exited before the cells registered"
        if any(log.glob("*.seg")):
            first: dict[str, str] = {}
            for event in LogReader(log).events(kinds=["cell_registered"]):
                first.setdefault(event.cell_id, event.address or "")
            if len(first) == 4:
                return {cell: next(n for prefix, n in by_address.items() if address.startswith(prefix))
                        for cell, address in first.items()}
        time.sleep(0.2)
    raise AssertionError("the cells did not register in time")


def _kv_across_hosts(hosts: Hosts, env: dict[str, str]) -> dict:
    """A call's KV moves from an engine on host b to one on host c the way the proxy's mover moves it (the
    proxy, on host a, drives it), then both engines are stopped."""
    urls = {}
    for name in ("b", "c"):
        address = hosts[name].address
        hosts.spawn(name, [sys.executable, "-m", "gyre", "engine", "serve", "--host", "0.0.0.0", "--advertise",
                           address, "--port", "30000"], env=env, log="engine.out")
        urls[name] = f"http://{address}:30000"
    mover = hosts.spawn("a", [sys.executable, "-m", "tests.cluster.kv_across", urls["b"], urls["c"]], env=env,
                        log="kv.out")
    assert mover.wait(timeout=180) == 0, (hosts["a"].disk / "kv.out").read_text()[-3000:]
    hosts.kill("b")
    hosts.kill("c")
    return json.loads((hosts["a"].disk / "kv.out").read_text().strip().splitlines()[-1])


@pytest.mark.skipif(available() is not None, reason=f"{available()}")
def test_a_run_across_three_hosts_survives_losing_one(tmp_path: Path) -> None:
    secret = auth.mint(auth.RUN_PREFIX)
    env = {**os.environ, SECRET_ENV: secret, "PYTHONPATH": str(REPO)}
    with Hosts(tmp_path, list(HOSTS)) as hosts:
        run_dir = hosts.root / "run"  # the same path on every host, a different disk behind it
        controller_address = f"{hosts['a'].address}:{PORT}"
        for name in HOSTS:  # one config file per host, on that host's disk
            cluster = {"advertise": hosts["a"].address} if name == "a" else {}
            (hosts[name].disk / "run.json").write_text(_config(run_dir, **cluster).model_dump_json())
        config = str(hosts.root / "run.json")
        moved = _kv_across_hosts(hosts, env)
        assert moved["equal"] and moved["pages"] > 0 and moved["bytes"] > 0, moved
        assert moved["source_session"].startswith(f"{hosts['b'].address}:")  # c read b's pages over Mooncake
        assert moved["target_cached"] >= moved["cached_tokens"] > 0  # c continued from the moved pages
        controller = hosts.spawn("a", [sys.executable, "-m", "gyre", "run", config], env=env, log="controller.out")
        for name, processes in HOSTS.items():
            for process in processes:
                if process != "controller":
                    hosts.spawn(name, process_argv(process, controller_address, config), env=env,
                                log=f"{process}.out")
        log = hosts["a"].disk / "run" / "log"
        _wait_until_weights_crossed(log, controller, time.monotonic() + 150, cells={"cell2", "cell3"})
        hosts.cut("c")
        try:
            assert controller.wait(timeout=180) == 0, (hosts["a"].disk / "controller.out").read_text()[-3000:]
        finally:
            hosts.kill("a")
            hosts.kill("b")

    events = list(LogReader(log).events())
    finished = [e for e in events if isinstance(e, RunFinished)]
    assert finished and finished[-1].status == "completed"
    host_of = {e.cell_id: e.address for e in events if isinstance(e, CellRegistered)}
    assert host_of["cell0"].startswith("http://10.77.0.2:") and host_of["cell2"].startswith("http://10.77.0.3:")
    assert {e.cell_id for e in events if isinstance(e, CellLost)} == {"cell2", "cell3"}
    assert _crossed(log, {"cell2", "cell3"}) > 0
    report = audit(log, expected_steps=STEPS)
    assert report.ok, report.problems
    replayed = replay_decisions(log)
    assert replayed.decisions > 0 and not replayed.mismatches
    for name in ("b", "c"):  # nothing of the run's log or weights reached another host's disk
        assert not (hosts[name].disk / "run" / "log").exists()
    assert not list((hosts["a"].disk / "run").glob("weights/*.safetensors"))


def _gated_harness(disk: Path, root: Path) -> None:
    """The demo's harness (agents/toy_agent/harness-tailed.toml) on a host's disk, with `--env-gate` on a file
    there (created open) that the sandbox sees through `ro_mounts`, and no time limit a held execution could hit."""
    tailed = tomllib.loads((REPO / "agents" / "toy_agent" / "harness-tailed.toml").read_text())
    command = [*tailed["command"], "--env-gate", str(root / "gate" / "open")]
    (disk / "gate").mkdir()
    (disk / "gate" / "open").touch()
    (disk / "harness.toml").write_text("\n".join([
        f"name = {json.dumps(tailed['name'] + '-gated')}",
        f"config_dir = {json.dumps(str(REPO / 'agents' / 'toy_agent'))}",
        f"command = {json.dumps(command)}",
        f"timeout_s = {HANG_S}",
        f"kill_grace_s = {tailed['kill_grace_s']}",
        f"max_concurrency = {tailed['max_concurrency']}",
        f"ro_mounts = {json.dumps([str(root / 'gate')])}",
    ]) + "\n")


def _wait_until_registered_again(log: Path, controller: subprocess.Popen, deadline: float, cells: set[str]) -> None:
    """Until every cell of ``cells`` has registered a second time (its replacement actor's process is up)."""
    while time.monotonic() < deadline:
        assert controller.poll() is None, "the controller exited before the lost cells were replaced"
        seen = [e.cell_id for e in LogReader(log).events(kinds=["cell_registered"]) if e.cell_id in cells]
        if all(seen.count(cell) >= 2 for cell in cells):
            return
        time.sleep(0.5)
    raise AssertionError(f"{sorted(cells)} did not register again in time")


RAY_PORT = 6379
WAIT_FOR_NODES = """
import sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False)
deadline = time.monotonic() + 120
while sum(n["Alive"] for n in ray.nodes()) < int(sys.argv[2]):
    assert time.monotonic() < deadline, ray.nodes()
    time.sleep(0.5)
"""
"""Run on host a before the controller starts: the placement group is made once every node has joined, so
SPREAD puts cells on every host."""


@pytest.mark.slow
@pytest.mark.skipif(available() is not None, reason=f"{available()}")
def test_a_ray_run_across_three_hosts_survives_losing_one(tmp_path: Path) -> None:
    """The same demo launched through Ray: a head on host a (with the controller), workers on b and c; cells
    are placed by a SPREAD placement group. A worker host without the core (whose disk holds the checkpoints) is
    cut once a cell there has pulled weights; Ray reports its actors dead, the controller records the cells lost
    and starts new actors in their bundles, which Ray moves to the other hosts; the run finishes, audited and
    replayed.

    Ordered by facts, not by speed: from the cut until the replacements have registered, every execution waits
    at its next environment step (the toy agent's `--env-gate`, a file on each host's disk), so the run cannot
    finish first — on a loaded machine it did, before Ray had restarted the lost actor."""
    import secrets
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="g", dir="/tmp"))  # Ray's socket paths must stay under 108 bytes
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    ray = [str(Path(sys.executable).parent / "ray"), "start", "--block", "--temp-dir", str(root / "ray"),
           "--disable-usage-stats"]
    try:
        with Hosts(tmp_path, list(HOSTS), root=root) as hosts:
            head = f"{hosts['a'].address}:{RAY_PORT}"
            health = '{"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, ' \
                     '"health_check_failure_threshold": 3}'
            hosts.spawn("a", [*ray, "--head", "--node-ip-address", hosts["a"].address, "--port", str(RAY_PORT),
                              "--num-cpus", "2", "--include-dashboard=false", "--system-config", health],
                        env=env, log="ray.out")
            for name in ("b", "c"):
                hosts.spawn(name, [*ray, "--address", head, "--node-ip-address", hosts[name].address,
                                   "--num-cpus", "3"], env=env, log="ray.out")
            waited = hosts.spawn("a", [sys.executable, "-c", WAIT_FOR_NODES, head, "3"], env=env, log="nodes.out")
            assert waited.wait(timeout=180) == 0, (hosts["a"].disk / "nodes.out").read_text()[-3000:]
            run_dir = hosts.root / "run"
            cluster = {"launcher": "ray", "advertise": hosts["a"].address, "port": 0, "dead_after_s": 10.0,
                       "ray": RaySection(address=head, cpus_per_cell=1.0, proxy_cpus=1.0, strategy="SPREAD")}
            config = _config(run_dir, RAY_STEPS, **cluster)
            config = config.model_copy(update={"rollout": config.rollout.model_copy(update={
                "harness": hosts.root / "harness.toml", "timeout_s": HANG_S})})
            for name in HOSTS:  # the proxy may land on any host: each disk has the harness and an open gate
                _gated_harness(hosts[name].disk, hosts.root)
            (hosts["a"].disk / "run.json").write_text(config.model_dump_json())
            controller = hosts.spawn("a", [sys.executable, "-m", "gyre", "run", str(hosts.root / "run.json")],
                                     env=env, log="controller.out")
            log = hosts["a"].disk / "run" / "log"
            placed = _placement(log, controller, time.monotonic() + 240)
            core_host = placed["cell0"]  # the core's disk holds its checkpoints: the host cut is another
            candidates = [n for n in ("c", "b") if n != core_host and n in placed.values()]
            assert candidates, f"SPREAD put no cell on a worker host without the core: {placed}"
            victim = candidates[0]
            victim_address = hosts[victim].address
            on_victim = {cell for cell, name in placed.items() if name == victim}
            _wait_until_weights_crossed(log, controller, time.monotonic() + 240, cells=on_victim)
            for name in HOSTS:  # the executions hold at their next environment step until the gate opens again
                (hosts[name].disk / "gate" / "open").unlink()
            hosts.cut(victim)
            try:
                _wait_until_registered_again(log, controller, time.monotonic() + HANG_S, cells=on_victim)
                for name in HOSTS:
                    if name != victim:
                        (hosts[name].disk / "gate" / "open").touch()
                assert controller.wait(timeout=HANG_S) == 0, \
                    (hosts["a"].disk / "controller.out").read_text()[-3000:]
            finally:
                hosts.kill("a")
                hosts.kill("b")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    events = list(LogReader(log).events())
    assert [e.status for e in events if isinstance(e, RunFinished)] == ["completed"]
    assert {e.cell_id for e in events if isinstance(e, CellLost)} == on_victim
    again = [e for e in events if isinstance(e, CellRegistered) and e.cell_id in on_victim][len(on_victim):]
    assert {e.cell_id for e in again} == on_victim  # new actors, in the bundles Ray moved off the lost node
    assert not any(e.address.startswith(f"http://{victim_address}:") for e in again), again
    report = audit(log, expected_steps=RAY_STEPS)
    assert report.ok, report.problems
    assert not replay_decisions(log).mismatches
