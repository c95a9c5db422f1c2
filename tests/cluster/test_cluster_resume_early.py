"""A controller killed before it listened (chaos kills at any point): its run resumes as a new one would.

The run's start recorded `run_started` and wrote its secret, then died before the hub listened, so no
controller address was written and no process was started: `--resume` starts them, with no address to
read, and the run completes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre.audit import audit
from gyre.cluster.config import ClusterSection
from gyre.cluster.hub import Hub
from gyre.cluster.run import ADDRESS, ClusterRun
from gyre.log import LogReader
from tests.cluster.test_cluster_run import cluster_config

pytestmark = pytest.mark.integration


class Killed(BaseException):
    """Stands for the SIGKILL: nothing of the controller runs after it."""


def test_a_run_killed_before_it_listened_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = cluster_config(tmp_path / "run", steps=1)
    config = base.model_copy(update={"cluster": ClusterSection(cells=2, slots=2, core="cell0", heartbeat_s=0.5,
                                                               dead_after_s=60)})

    def killed(self: Hub) -> str:
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(Hub, "start", killed)
        with pytest.raises(Killed):
            ClusterRun(config).run()
    assert not (config.run_dir / ADDRESS).exists()
    assert [e.kind for e in LogReader(config.run_dir / "log").events()] == ["run_started"]

    summary = ClusterRun(config, resume=True).run()
    assert summary.status == "completed" and [s.step for s in summary.steps] == [0]
    assert audit(summary.log, expected_steps=1).ok
