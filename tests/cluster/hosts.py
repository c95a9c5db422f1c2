"""Three "hosts" on one machine: Linux network namespaces on a bridge, each with its own address and its own
private directory tree, for tests of a run spread over several machines.

Each host is a network namespace (``ip netns``) holding one end of a veth pair whose other end sits on a
bridge in a switch namespace (the machine's own network is untouched). Every process a host runs also gets
a mount namespace in which ``root`` shows that host's disk and the directory of all the disks is covered
by an empty tmpfs: no process can open another host's files, so anything that leans on a shared
filesystem fails. The test itself (outside) reads every disk, to check what each host wrote.
Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; `available()` says why not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def available() -> str | None:
    """None when namespaces can be made here; else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2 / util-linux)"
    probe = f"gyre-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    name: str
    netns: str
    address: str
    disk: Path
    processes: list[subprocess.Popen] = field(default_factory=list)


class Hosts:
    """``Hosts(tmp, ["a", "b", "c"])``: host ``a`` at 10.77.0.1, ``b`` at .2, ...; a context manager."""

    def __init__(self, tmp: Path, names: Sequence[str], subnet: str = "10.77.0", root: Path | None = None) -> None:
        """``root``: the mount point (default ``tmp/root``; Ray wants a short one: its socket paths live there)."""
        self.tag = f"g{os.getpid() % 100000}"
        self.disks = tmp / "disks"
        self.root = root or tmp / "root"
        """Where each host's processes see their own disk (the same path on every host)."""
        self.switch = f"{self.tag}-sw"
        self.hosts = {name: Host(name, f"{self.tag}-{name}", f"{subnet}.{i + 1}", self.disks / name)
                      for i, name in enumerate(names)}

    def __enter__(self) -> Hosts:
        self.root.mkdir(parents=True, exist_ok=True)
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts.values()):
            host.disk.mkdir(parents=True, exist_ok=True)
            _ip("netns", "add", host.netns)
            _ip("link", "add", f"{self.tag}h{i}", "type", "veth", "peer", "name", f"{self.tag}s{i}")
            _ip("link", "set", f"{self.tag}h{i}", "netns", host.netns, "name", "eth0")
            _ip("link", "set", f"{self.tag}s{i}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"{self.tag}s{i}", "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        return self

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def spawn(self, name: str, argv: Sequence[str], *, env: Mapping[str, str], log: str) -> subprocess.Popen:
        """Run ``argv`` on host ``name`` (its network, its disk at ``root``); output to ``<disk>/<log>``."""
        host = self.hosts[name]
        mounts = f'mount --bind "{host.disk}" "{self.root}" && mount -t tmpfs none "{self.disks}" && exec "$@"'
        with open(host.disk / log, "ab") as out:
            process = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, "unshare", "--mount", "--propagation", "private", "--",
                 "sh", "-c", mounts, "sh", *argv],
                env=dict(env), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        host.processes.append(process)
        return process

    def cut(self, name: str) -> None:
        """The host drops off the network, then every process it runs dies (a power cut, seen from outside)."""
        host = self.hosts[name]
        _ip("-n", host.netns, "link", "set", "eth0", "down")
        self.kill(name)

    def kill(self, name: str) -> None:
        """Every process of the host: those it started, and any other in its network namespace (daemons that
        left the process group)."""
        processes, self.hosts[name].processes = self.hosts[name].processes, []
        for process in processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        listed = subprocess.run(["ip", "netns", "pids", self.hosts[name].netns], capture_output=True, text=True)
        for pid in listed.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        for process in processes:
            process.wait()

    def __exit__(self, *exc: object) -> None:
        for name in self.hosts:
            self.kill(name)
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", self.switch], check=False, capture_output=True)
