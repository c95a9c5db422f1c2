"""The first process inside an execution's sandbox: listen for the proxy, limit, drop privileges, run the harness.

    python -I -S /run/gyre/init.py SETUP_JSON -- HARNESS_ARGV...

SETUP_JSON: {"limits": {"nproc"|"fsize"|"as"|"nofile": n}, "uid": int|null, "gid": int|null,
             "port": int|null, "relay": "/run/gyre/proxy.sock"|null}

In order, each step before the next because it needs what the previous one still has:
1. bind 127.0.0.1:port (and ::1:port) in the sandbox's network namespace, as root (a port below 1024 works);
2. set the rlimits (hard and soft: the harness cannot raise them again);
3. drop to uid/gid with no supplementary groups (bwrap has set no_new_privs: no setuid binary regains them);
4. fork and exec the harness (before any thread exists: forking a threaded process is unsafe);
5. relay every connection to the listener over the Unix socket, until the harness exits; exit with its
   status (128 + signal when it was killed).
The relay runs as the harness's uid in one thread with a selector, so it takes one process slot of the
harness's `nproc`, however many connections there are. It imports only the standard library (the gyre
package is not mounted in the sandbox) and must start fast: every execution pays for it.
"""

import json
import os
import resource
import selectors
import socket
import sys

LIMITS = {"nproc": resource.RLIMIT_NPROC, "fsize": resource.RLIMIT_FSIZE, "as": resource.RLIMIT_AS,
          "nofile": resource.RLIMIT_NOFILE}
CHUNK = 1 << 16
HIGH_WATER = 1 << 20
"""Bytes buffered toward one side before the other is no longer read (backpressure)."""


def listen(port):
    listeners = []
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
        except OSError:
            if family == socket.AF_INET:
                raise
            continue  # no IPv6 loopback in this kernel: 127.0.0.1 is what base URLs name
        sock.setblocking(False)
        listeners.append(sock)
    return listeners


def limit(limits):
    for name, value in limits.items():
        resource.setrlimit(LIMITS[name], (value, value))


def drop(uid, gid):
    if uid is None:
        return
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError(f"could not drop to uid {uid}")


def start(command):
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(command[0], command)
        except OSError as e:
            os.write(2, f"sandbox: cannot start {command[0]!r}: {e}\n".encode())
        os._exit(127)
    return pid


class Relay:
    """Pumps bytes between accepted TCP connections and fresh connections to the Unix socket."""

    def __init__(self, listeners, path):
        self.path = path
        self.selector = selectors.DefaultSelector()
        self.peer = {}      # socket -> its partner
        self.outbox = {}    # socket -> bytes waiting to be written to it
        self.eof = set()    # sockets that have reached EOF when read
        for sock in listeners:
            self.selector.register(sock, selectors.EVENT_READ, "listen")

    def run_until(self, pidfd):
        self.selector.register(pidfd, selectors.EVENT_READ, "child")
        while True:
            for key, _ in self.selector.select():
                if key.data == "child":
                    return
                if key.data == "listen":
                    self.accept(key.fileobj)
                elif key.fileobj in self.peer:
                    self.pump(key.fileobj)

    def accept(self, listener):
        try:
            conn, _ = listener.accept()
        except OSError:  # out of file descriptors (nofile): the caller's connect fails, nothing else
            return
        try:
            up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError:
            conn.close()
            return
        try:
            up.connect(self.path)
        except OSError as e:
            os.write(2, f"sandbox: the proxy relay is unreachable: {e}\n".encode())
            conn.close()
            up.close()
            return
        for sock, other in ((conn, up), (up, conn)):
            sock.setblocking(False)
            self.peer[sock] = other
            self.outbox[sock] = b""
            self.selector.register(sock, selectors.EVENT_READ)

    def pump(self, sock):
        other = self.peer[sock]
        try:
            if self.outbox[sock]:
                sent = sock.send(self.outbox[sock])
                self.outbox[sock] = self.outbox[sock][sent:]
                if not self.outbox[sock] and other in self.eof:
                    sock.shutdown(socket.SHUT_WR)
            if sock not in self.eof and len(self.outbox[other]) < HIGH_WATER:
                data = sock.recv(CHUNK)
                if data:
                    self.outbox[other] += data
                else:
                    self.eof.add(sock)
                    if not self.outbox[other]:
                        other.shutdown(socket.SHUT_WR)
        except BlockingIOError:
            pass
        except OSError:
            self.close(sock)
            return
        if sock in self.eof and other in self.eof and not self.outbox[sock] and not self.outbox[other]:
            self.close(sock)
            return
        for s in (sock, other):
            self.interest(s)

    def interest(self, sock):
        if sock not in self.peer:
            return
        events = 0
        if sock not in self.eof and len(self.outbox[self.peer[sock]]) < HIGH_WATER:
            events |= selectors.EVENT_READ
        if self.outbox[sock]:
            events |= selectors.EVENT_WRITE
        key = self.selector.get_map().get(sock)
        if key is None:
            if events:
                self.selector.register(sock, events)
        elif not events:
            self.selector.unregister(sock)  # its partner's progress re-registers it
        elif key.events != events:
            self.selector.modify(sock, events)

    def close(self, sock):
        for s in (sock, self.peer.get(sock)):
            if s is None or s not in self.peer:
                continue
            if s in self.selector.get_map():
                self.selector.unregister(s)
            del self.peer[s], self.outbox[s]
            self.eof.discard(s)
            s.close()


def main(argv):
    setup = json.loads(argv[1])
    command = argv[3:]
    listeners = listen(setup["port"]) if setup.get("relay") and setup.get("port") else []
    limit(setup.get("limits", {}))
    drop(setup.get("uid"), setup.get("gid"))
    pid = start(command)
    pidfd = os.pidfd_open(pid)
    if listeners:
        Relay(listeners, setup["relay"]).run_until(pidfd)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
