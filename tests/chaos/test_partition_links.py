"""The partition benchmark's links (`benchmarks/chaos_partition.py`): a cut drops every packet between two
network-namespace hosts, both ways, and only between them; healing it lets them through again."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from benchmarks.chaos_partition import Links, unavailable
from tests.cluster.hosts import Hosts

pytestmark = [pytest.mark.integration, pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}")]


def _reaches(hosts: Hosts, source: str, target: str) -> bool:
    """One TCP connection from ``source`` to a listener on ``target`` (no timing: refused or accepted within
    the connect timeout, which only a dropped SYN runs out)."""
    listen = subprocess.Popen(["ip", "netns", "exec", hosts[target].netns, "python3", "-c",
                               "import socket; s = socket.create_server(('0.0.0.0', 7801)); print('up', flush=True); "
                               "s.settimeout(10); s.accept()"], stdout=subprocess.PIPE, text=True)
    try:
        assert listen.stdout is not None and listen.stdout.readline().strip() == "up"
        done = subprocess.run(["ip", "netns", "exec", hosts[source].netns, "python3", "-c",
                               f"import socket; socket.create_connection(('{hosts[target].address}', 7801), "
                               "timeout=2)"], capture_output=True)
        return done.returncode == 0
    finally:
        listen.kill()
        listen.wait()


def test_a_cut_drops_both_ways_between_two_hosts_only_and_heals(tmp_path: Path) -> None:
    with Hosts(tmp_path, ["a", "b", "c"], subnet="10.78.0") as hosts:
        links = Links(hosts, loss_pct=0.0, delay_ms=0.0)
        links.shape()
        assert _reaches(hosts, "b", "c")
        links.cut("b", "c")
        assert not _reaches(hosts, "b", "c") and not _reaches(hosts, "c", "b")
        assert _reaches(hosts, "a", "c") and _reaches(hosts, "b", "a")  # the other links still carry
        links.heal("b", "c")
        assert _reaches(hosts, "c", "b")
