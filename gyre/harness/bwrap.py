"""The bubblewrap sandbox of one execution (or evaluation): what it sees, what it may do, and the argv.

A sandboxed process gets its own mount, PID, network, IPC and UTS namespaces:
- the filesystem is built from nothing: the system (/usr, /lib*, /bin, a few /etc files) and the
  interpreter read-only, the workspace and a fresh home read-write at their own paths, a size-limited
  tmpfs /tmp, a minimal /dev and a /proc of its own PID namespace. Nothing else of the host exists in
  it: not the run directory (secrets.toml, the log, weights), not the checkout that holds the task sets,
  not another execution's directory;
- the network namespace has only loopback. `sandbox_init` (the first process inside) listens on the
  proxy's port there and relays each connection over a Unix socket bound into the sandbox to the
  runner's `ProxyRelay`, which alone connects to the real proxy: the harness's `*_BASE_URL` works
  unmodified and nothing else is reachable;
- it runs as an unprivileged uid/gid of its own (one per running execution, so a fork bomb exhausts its
  own `nproc`, not a neighbour's), with rlimits on processes, file size, address space and open files.

Trap: bubblewrap run by root creates no user namespace when it is not asked to; then `--uid` is
unavailable and the first process inside is real root with every capability. So as root the sandbox
asks for no user namespace and `sandbox_init` drops to the execution's uid (setgroups, setgid, setuid)
before anything else runs; bwrap has set `no_new_privs`, so nothing inside can regain privileges. A
user namespace would not do: its root maps to host root, whose processes `RLIMIT_NPROC` never counts.
Run by another user, the sandbox takes a user namespace and keeps that user's uid (nproc then counts
all of that user's processes).

Wall time stays with the runner (`GroupProcess`): killing bwrap kills its init (`--die-with-parent`),
and the end of a PID namespace's init kills everything in it, double-forked daemons included.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gyre.harness.errors import HarnessError

INIT_SCRIPT = Path(__file__).with_name("sandbox_init.py")
INIT_PATH = "/run/gyre/init.py"
"""Where `sandbox_init.py` is bound inside the sandbox (the gyre package itself is not)."""
RELAY_PATH = "/run/gyre/proxy.sock"
"""Where the execution's relay socket is bound inside the sandbox."""
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("passwd", "group", "hosts", "nsswitch.conf", "localtime", "timezone", "ld.so.cache", "ld.so.conf",
             "ld.so.conf.d", "alternatives", "ssl", "ca-certificates", "ca-certificates.conf", "mime.types")
"""What of /etc a harness needs: name lookup, dynamic linking, TLS roots, Debian's /usr/bin symlinks."""
FIX = "install bubblewrap (`make syslibs`, or `apt-get install bubblewrap`), or set sandbox = \"none\" in the " \
      "harness configuration to run executions unsandboxed"


class SandboxUnavailable(HarnessError):
    """bubblewrap is missing or cannot create namespaces here; the message names the cause and the fix."""


@dataclass(frozen=True)
class Limits:
    """rlimits applied inside the sandbox before the harness starts (None: inherited)."""

    nproc: int | None = None
    fsize_bytes: int | None = None
    memory_bytes: int | None = None
    nofile: int | None = None

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in (("nproc", self.nproc), ("fsize", self.fsize_bytes), ("as", self.memory_bytes),
                                  ("nofile", self.nofile)) if v is not None}


@dataclass(frozen=True)
class SandboxSpec:
    """Everything one sandboxed process may see and do. Paths are bound at the same path inside."""

    workspace: Path
    writable: tuple[Path, ...] = ()
    """Read-write besides the workspace (the home, an evaluator's scratch directory)."""
    readable: tuple[Path, ...] = ()
    """Read-only: the interpreter, the harness's own files, `ro_mounts`, the task file, graders."""
    uid: int | None = None
    """The uid and gid to drop to inside (as root); None keeps the caller's (a user namespace)."""
    limits: Limits = field(default_factory=Limits)
    relay_socket: Path | None = None
    """The Unix socket of this execution's `ProxyRelay`; None: no way out at all."""
    proxy_port: int | None = None
    """The loopback port the harness's base URL names; the relay inside listens on it."""
    rootfs: Path | None = None
    """A directory used as / (an unpacked container image) instead of the host's system directories."""
    tmp_bytes: int = 512 << 20

    def argv(self, command: Sequence[str]) -> list[str]:
        """The bwrap command line that runs `command` in this sandbox (through `sandbox_init`)."""
        return [*bwrap_prefix(self), "--", *init_command(self, command)]


def bwrap_prefix(spec: SandboxSpec) -> list[str]:
    args = [bwrap_path(), "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
    if spec.uid is None:
        args.append("--unshare-user")
    if spec.rootfs is not None:
        # Bound writable so that bwrap can create the mount points below, remounted read-only at the end.
        args += ["--bind", str(spec.rootfs), "/"]
    else:
        for path in SYSTEM_DIRS:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        args += ["--perms", "0755", "--dir", "/etc"]  # made by bwrap otherwise, mode 0700 (see _parents)
        for name in ETC_FILES:
            args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(spec.tmp_bytes), "--tmpfs", "/tmp"]
    readable = _outermost([*interpreter_paths(), *spec.readable])
    writable = [spec.workspace, *spec.writable]
    # bwrap creates a bind's missing parents mode 0700: the dropped uid could not walk through them.
    for parent in _parents([*readable, *writable, Path(INIT_PATH)]):
        args += ["--perms", "0755", "--dir", str(parent)]
    for path in readable:
        args += ["--ro-bind", str(path), str(path)]
    for path in writable:
        args += ["--bind", str(path), str(path)]
    args += ["--ro-bind", str(INIT_SCRIPT), INIT_PATH]
    if spec.relay_socket is not None:
        args += ["--bind", str(spec.relay_socket), RELAY_PATH]
    if spec.rootfs is not None:
        args += ["--remount-ro", "/"]
    args += ["--chdir", str(spec.workspace)]
    return args


def init_command(spec: SandboxSpec, command: Sequence[str]) -> list[str]:
    setup = [f"{name}={value}" for name, value in spec.limits.as_dict().items()]
    if spec.uid is not None:
        setup.append(f"uid={spec.uid}")
    if spec.relay_socket is not None and spec.proxy_port is not None:
        setup += [f"port={spec.proxy_port}", f"relay={RELAY_PATH}"]
    return [sys.executable, "-I", "-S", INIT_PATH, *setup, "--", *command]


def interpreter_paths() -> list[Path]:
    """What `sys.executable` needs to start: the venv (its prefix) and the installation it was made from."""
    paths = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent.parent}
    return sorted(p for p in paths if str(p) not in ("/", "/usr"))


def _outermost(paths: Iterable[Path]) -> list[Path]:
    """Existing paths, absolute, without one that lies inside another (a bind over a bind is wasted)."""
    unique = sorted({Path(os.path.abspath(p)) for p in paths if os.path.exists(p)}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in unique:
        if not any(path.is_relative_to(k) for k in kept) and not _is_system(path):
            kept.append(path)
    return kept


def _parents(paths: Iterable[Path]) -> list[Path]:
    """The directories above `paths` that the sandbox's root does not have yet, outermost first."""
    found = {parent for p in paths for parent in p.parents if parent != Path("/") and parent != Path("/tmp")}
    return sorted((p for p in found if not _is_system(p)), key=lambda p: (len(p.parts), str(p)))


def _is_system(path: Path) -> bool:
    return any(path.is_relative_to(d) and not os.path.islink(d) for d in SYSTEM_DIRS if os.path.isdir(d))


@functools.cache
def bwrap_path() -> str:
    """The bwrap program; `SandboxUnavailable` when it is not installed."""
    found = shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/usr/local/bin/bwrap")
                                           if os.access(p, os.X_OK)), None)
    if found is None:
        raise SandboxUnavailable(f"executions run sandboxed, but bubblewrap (`bwrap`) is not installed: {FIX}")
    return found


_checked: dict[tuple[bool, str], None] = {}
_check_lock = threading.Lock()


def check_available(*, as_root: bool | None = None) -> None:
    """Start one trivial sandbox (once per process): `SandboxUnavailable` with bwrap's own words if it fails.

    Namespaces can be refused by the kernel (`user.max_user_namespaces = 0`), by a container's seccomp
    profile or by AppArmor; the probe turns each into one error at start-up instead of every execution
    failing as a `harness_error`.
    """
    root = os.geteuid() == 0 if as_root is None else as_root
    key = (root, bwrap_path())
    with _check_lock:
        if key in _checked:
            return
        spec = SandboxSpec(workspace=Path("/"), uid=65534 if root else None)
        argv = [*bwrap_prefix(spec)[:-2], "--", "/bin/true"]  # without its --chdir
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SandboxUnavailable(f"cannot run bubblewrap ({key[1]}): {e}; {FIX}") from e
        if done.returncode != 0:
            said = done.stderr.strip() or f"exit code {done.returncode}"
            raise SandboxUnavailable(f"bubblewrap cannot create the sandbox's namespaces here ({said}); "
                                     "namespaces need a kernel with user.max_user_namespaces > 0 (or root) and no "
                                     f"container profile that forbids them; {FIX}")
        _checked[key] = None


class UidPool:
    """One unprivileged uid per running execution, distinct from other runners' on the same host.

    Each runner process takes a block of `BLOCK` uids above `BASE` chosen by its pid (pids are unique among
    running processes); none of them has a passwd entry, a home or files outside its workspace.
    """

    BASE = 1_500_000_000
    BLOCK = 1024
    _shared: UidPool | None = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> UidPool:
        """The process's pool: runners in one process (a benchmark's two) must not hand out the same uid."""
        with cls._shared_lock:
            if cls._shared is None or cls._shared.pid != os.getpid():  # a forked child takes its own block
                cls._shared = cls()
            return cls._shared

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.first = self.BASE + (os.getpid() % 400_000) * self.BLOCK
        self._free = list(range(self.BLOCK))
        self._lock = threading.Lock()

    def acquire(self) -> int:
        with self._lock:
            if not self._free:
                raise HarnessError(f"more than {self.BLOCK} sandboxed executions at once")
            self._free.sort()
            return self.first + self._free.pop(0)

    def release(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid - self.first)


def give_to(uid: int | None, *paths: Path) -> None:
    """chown every file under `paths` to `uid` (its gid the same): the sandboxed process must own its files."""
    if uid is None:
        return
    for top in paths:
        os.chown(top, uid, uid, follow_symlinks=False)
        for here, dirs, files in os.walk(top):
            for name in dirs + files:
                os.chown(os.path.join(here, name), uid, uid, follow_symlinks=False)
