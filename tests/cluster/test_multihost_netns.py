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
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre import auth
from gyre.audit.rules import audit
from gyre.cluster.auth import SECRET_ENV
from gyre.cluster.config import ClusterConfig
from gyre.cluster.run import process_argv
from gyre.events.models import CellLost, CellRegistered, RunFinished
from gyre.log import LogReader
from gyre.replay.exact import replay_decisions
from tests.cluster.hosts import Hosts, available

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]
PORT = 7700
STEPS = 2
HOSTS = {"a": ("controller", "proxy"), "b": ("cell0", "cell1"), "c": ("cell2", "cell3")}


def _config(run_dir: Path, **cluster: object) -> ClusterConfig:
    base = ClusterConfig.load(REPO / "examples" / "cluster-cpu.toml")
    settings = {"bind": "0.0.0.0", "port": PORT, "launcher": "manual", "heartbeat_s": 0.5, "dead_after_s": 4.0,
                "lease_s": 4.0, "slots": 4, **cluster}  # 4 slots: a cell still serving is lent (its calls move)
    return base.model_copy(update={"run_dir": run_dir, "steps": STEPS,
                                   "cluster": base.cluster.model_copy(update=settings)})


CROSSED = "SELECT count(*) FROM events WHERE cell_id IN ('cell2', 'cell3') AND (kind = 'micro_step_finished' " \
          "OR (kind = 'weights_loaded' AND weights_loaded.weights_bytes > 0))"
"""Facts that prove weights crossed hosts: a satellite on c computes a micro-step only on weights it pulled from
the core on b over Mooncake (and the core counts it once the gradients are in its slot); an engine on c loads
a published version by pulling it from the core the same way (c's disk has no weights file to fall back on)."""


def _wait_until_weights_crossed(log: Path, controller: subprocess.Popen, deadline: float) -> None:
    """Until the controller's log (read from host a's disk, outside) shows a cell on host c holding weights it
    pulled from host b: then host c is cut."""
    while time.monotonic() < deadline:
        assert controller.poll() is None, "the controller exited before weights crossed hosts"
        if any(log.glob("*.seg")) and LogReader(log).duckdb().execute(CROSSED).fetchone()[0] > 0:
            return
        time.sleep(0.2)
    raise AssertionError("no cell on host c pulled weights from the core on host b in time")


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
        _wait_until_weights_crossed(log, controller, time.monotonic() + 150)
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
    assert LogReader(log).duckdb().execute(CROSSED).fetchone()[0] > 0
    report = audit(log, expected_steps=STEPS)
    assert report.ok, report.problems
    replayed = replay_decisions(log)
    assert replayed.decisions > 0 and not replayed.mismatches
    for name in ("b", "c"):  # nothing of the run's log or weights reached another host's disk
        assert not (hosts[name].disk / "run" / "log").exists()
    assert not list((hosts["a"].disk / "run").glob("weights/*.safetensors"))
