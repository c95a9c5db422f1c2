"""A small synthetic run shared by the trajectory tests: realistic shape, few tokens."""

from pathlib import Path

import pytest
from trajectory_helpers import SMALL

from gyre.trajectory.synth_log import SynthSummary, synthesize


@pytest.fixture(scope="session")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SynthSummary]:
    path = tmp_path_factory.mktemp("trajectory") / "log"
    return path, synthesize(path, SMALL)
