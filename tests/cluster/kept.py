"""A failed test's run directory, kept out of pytest's rotation.

pytest keeps only its last three temporary trees, so a flaky failure's run was gone by the time anyone read it. A
module's run fixture names its directory (``request.node.stash[KEEP_ON_FAILURE] = root``); when a test of the module
fails, ``tests/cluster/conftest.py`` copies ``root`` to ``$GYRE_KEPT_RUNS`` (default ``<tmp>/gyre-kept-runs``) and
the failure's report names the copy. (The key lives here, not in the conftest: pytest imports a conftest under
its own name, so a test module importing it would get a second, different key.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

KEEP_ON_FAILURE = pytest.StashKey[Path]()
KEPT_RUNS_ENV = "GYRE_KEPT_RUNS"


def kept_copy(root: Path) -> Path:
    """``root`` copied, once per process (regular files and folders only: a run's sockets and pipes are skipped)."""
    base = Path(os.environ.get(KEPT_RUNS_ENV) or Path(tempfile.gettempdir()) / "gyre-kept-runs")
    done = sorted(base.glob(f"{root.name}-{os.getpid()}-*"))
    if done:
        return done[0]

    def special(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if not (os.path.isfile(p := os.path.join(folder, n)) or os.path.isdir(p))}

    target = base / f"{root.name}-{os.getpid()}-{time.strftime('%Y%m%dT%H%M%S')}"
    shutil.copytree(root, target, symlinks=True, ignore=special)
    return target
