"""`[cluster] launcher = "ray"`: a run whose cells and proxy are Ray actors in a placement group (a local head);
one cell's actor is killed mid-run, handled as a lost cell, and the run finishes audited and replayed.

Where network namespaces can be made (root, iproute2: CI), `tests/cluster/test_multihost_netns.py` runs the
same launcher across three hosts and loses a whole node, which covers this; the suite runs one of the two (a
Ray run costs minutes of 2 cores)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gyre.audit.rules import audit
from gyre.cluster.run import ClusterRun
from gyre.events.models import CellLost, CellRegistered, RunFinished
from gyre.log import LogReader
from gyre.replay.exact import replay_decisions
from tests.cluster.hosts import available
from tests.cluster.test_cluster_run import cluster_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VICTIM = "cell2"


@pytest.mark.skipif(available() is None, reason="the Ray run across network-namespace hosts covers this here")
def test_a_ray_launched_run_survives_a_lost_actor(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    base = cluster_config(tmp_path / "run", steps=2)
    config = base.model_copy(update={"cluster": base.cluster.model_copy(update={
        "launcher": "ray", "dead_after_s": 10.0, "ray": base.cluster.ray.model_copy(update={"cpus_per_cell": 0.5})})})
    killed = threading.Event()
    run = None

    def progress(phase: str, figures: dict) -> None:
        if phase == "switch" and not killed.is_set():  # the first completed switch: the run is under way
            killed.set()
            actor = ray.get_actor(f"{run.run_id}:{VICTIM}", namespace=config.cluster.ray.namespace)
            threading.Thread(target=ray.kill, args=(actor,), kwargs={"no_restart": True}).start()

    run = ClusterRun(config, progress)
    summary = run.run()
    assert killed.is_set() and summary.status == "completed"
    assert not ray.is_initialized()  # the local head the launcher started ended with the run
    events = list(LogReader(summary.log).events())
    lost = [e for e in events if isinstance(e, CellLost)]
    assert [e.cell_id for e in lost] == [VICTIM] and "Ray actor died" in lost[0].reason
    registered = [e for e in events if isinstance(e, CellRegistered) and e.cell_id == VICTIM]
    assert len(registered) == 2 and registered[0].incarnation != registered[1].incarnation  # a new actor's
    assert isinstance(events[-1], RunFinished)
    report = audit(summary.log, expected_steps=2)
    assert report.ok, report.problems
    assert not replay_decisions(summary.log).mismatches
