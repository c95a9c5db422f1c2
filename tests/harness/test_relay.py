"""The relay directory's lifetime: gone at the end of its process, and swept when its process was killed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gyre.harness import relay
from gyre.harness.relay import PREFIX, SUN_PATH_MAX, ProxyRelay, owner_tag, relay_base

OWNER = """
import importlib.util, os, signal, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("relay", sys.argv[3])  # the module alone: no package import
relay_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(relay_module)
relay = relay_module.ProxyRelay("127.0.0.1", 9, tmp_dir=Path(sys.argv[1]))
relay.open()
print(relay.dir, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gyre-t-", dir="/tmp"))  # short: socket paths must fit sun_path
    yield path
    shutil.rmtree(path, ignore_errors=True)


def owner(base: Path, how: str) -> tuple[Path, int]:
    done = subprocess.run([sys.executable, "-c", OWNER, str(base), how, relay.__file__], capture_output=True,
                          text=True, timeout=60)
    return Path(done.stdout.strip()), done.returncode


def test_a_relay_directory_goes_at_exit_even_unstopped(base: Path) -> None:
    path, code = owner(base, "exit")
    assert code == 0 and path.parent == base and not path.exists()


def test_the_next_relay_sweeps_the_directories_of_killed_owners_only(base: Path) -> None:
    killed, code = owner(base, "kill")
    assert code == -signal.SIGKILL and (killed / "0.sock").exists()  # SIGKILL left it behind
    reused = base / f"{PREFIX}{os.getpid()}-1-abcdefgh"  # this pid, another process's start time: pid reuse
    reused.mkdir()
    live = ProxyRelay("127.0.0.1", 9, tmp_dir=base)
    other = base / "gyre-relay-unrelated"
    other.mkdir()
    try:
        assert not killed.exists() and not reused.exists()
        assert live.dir.name.startswith(f"{PREFIX}{owner_tag(os.getpid())}-")
        second = ProxyRelay("127.0.0.1", 9, tmp_dir=base)  # a live owner's directory is kept
        assert live.dir.exists() and other.exists()
        second.stop()
        assert not second.dir.exists()
    finally:
        live.stop()
    assert sorted(base.iterdir()) == [other]


def test_socket_paths_fit_sun_path_under_a_deep_tmpdir() -> None:
    assert relay_base(Path("/tmp/" + "d" * 90)) == Path("/tmp")
    assert len(f"{relay_base()}/{PREFIX}{4194304}-{2**64}-abcdefgh/1048575.sock") <= SUN_PATH_MAX
