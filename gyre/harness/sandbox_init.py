"""The first process inside an execution's sandbox: listen for the proxy, limit, drop privileges, run the harness.

    python -I -S /run/gyre/init.py [nproc=N] [fsize=N] [as=N] [nofile=N] [uid=N] [port=N relay=PATH] -- ARGV...

In order, each step before the next because it needs what the previous one still has:
1. bind 127.0.0.1:port (and ::1:port) in the sandbox's network namespace, as root (a port below 1024 works);
2. set the rlimits (hard and soft: the harness cannot raise them again);
3. drop to uid (gid the same) with no supplementary groups (bwrap has set no_new_privs: no setuid binary
   regains them);
4. fork and exec the harness (before any thread exists: forking a threaded process is unsafe);
5. relay every connection to the listener over the Unix socket, until the harness exits; exit with its
   status (128 + signal when it was killed).
The relay runs as the harness's uid in this one process with epoll, so it takes one slot of the harness's
`nproc` however many connections there are. It imports only builtin modules (the gyre package is not mounted
in the sandbox; `socket`, `json` and `selectors` would cost more start-up than all the rest: every
execution pays for it), hence `_socket` and plain key=value arguments.
"""

import _signal
import _socket
import os
import resource
import select
import sys

LIMITS = {"nproc": resource.RLIMIT_NPROC, "fsize": resource.RLIMIT_FSIZE, "as": resource.RLIMIT_AS,
          "nofile": resource.RLIMIT_NOFILE}
CHUNK = 1 << 16
HIGH_WATER = 1 << 20
"""Bytes buffered toward one side before the other is no longer read (backpressure)."""
READ, WRITE = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLHUP, select.EPOLLOUT


def listen(port):
    listeners = []
    for family, host in ((_socket.AF_INET, "127.0.0.1"), (_socket.AF_INET6, "::1")):
        try:
            sock = _socket.socket(family, _socket.SOCK_STREAM)
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
        except OSError:
            if family == _socket.AF_INET:
                raise
            continue  # no IPv6 loopback in this kernel: 127.0.0.1 is what base URLs name
        sock.setblocking(False)
        listeners.append(sock)
    return listeners


def limit(limits):
    for name, value in limits.items():
        resource.setrlimit(LIMITS[name], (value, value))


def drop(uid):
    if uid is None:
        return
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError(f"could not drop to uid {uid}")


def start(command):
    pid = os.fork()
    if pid == 0:
        for sig in (_signal.SIGTERM, _signal.SIGINT):  # an ignored signal would stay ignored across exec
            _signal.signal(sig, _signal.SIG_DFL)
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
        self.poll = select.epoll()
        self.listeners = {sock.fileno(): sock for sock in listeners}
        self.sock = {}      # fd -> socket
        self.peer = {}      # socket -> its partner
        self.outbox = {}    # socket -> bytes waiting to be written to it
        self.eof = set()    # sockets that have reached EOF when read
        self.events = {}    # socket -> the events it is registered for (absent: not registered)
        for fd in self.listeners:
            self.poll.register(fd, select.EPOLLIN)

    def run_until(self, pidfd):
        self.poll.register(pidfd, select.EPOLLIN)
        while True:
            for fd, _ in self.poll.poll():
                if fd == pidfd:
                    return
                if fd in self.listeners:
                    self.accept(self.listeners[fd])
                elif fd in self.sock:
                    self.pump(self.sock[fd])

    def accept(self, listener):
        try:
            fd, _ = listener._accept()
        except OSError:  # out of file descriptors (nofile), or gone: that caller's connect fails, nothing else
            return
        conn = _socket.socket(fileno=fd)
        try:
            up = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
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
            self.sock[sock.fileno()] = sock
            self.peer[sock] = other
            self.outbox[sock] = b""
        self.interest(conn)
        self.interest(up)

    def pump(self, sock):
        other = self.peer[sock]
        try:
            if self.outbox[sock]:
                sent = sock.send(self.outbox[sock])
                self.outbox[sock] = self.outbox[sock][sent:]
                if not self.outbox[sock] and other in self.eof:
                    sock.shutdown(_socket.SHUT_WR)
            if sock not in self.eof and len(self.outbox[other]) < HIGH_WATER:
                data = sock.recv(CHUNK)
                if data:
                    self.outbox[other] += data
                else:
                    self.eof.add(sock)
                    if not self.outbox[other]:
                        other.shutdown(_socket.SHUT_WR)
        except BlockingIOError:
            pass
        except OSError:
            self.close(sock)
            return
        if sock in self.eof and other in self.eof and not self.outbox[sock] and not self.outbox[other]:
            self.close(sock)
            return
        self.interest(sock)
        self.interest(other)

    def interest(self, sock):
        events = 0
        if sock not in self.eof and len(self.outbox[self.peer[sock]]) < HIGH_WATER:
            events |= READ
        if self.outbox[sock]:
            events |= WRITE
        registered = self.events.get(sock)
        if registered is None:
            if events:
                self.poll.register(sock.fileno(), events)
                self.events[sock] = events
        elif not events:
            self.poll.unregister(sock.fileno())  # its partner's progress registers it again
            del self.events[sock]
        elif registered != events:
            self.poll.modify(sock.fileno(), events)
            self.events[sock] = events

    def close(self, sock):
        for s in (sock, self.peer.get(sock)):
            if s is None or s not in self.peer:
                continue
            if self.events.pop(s, None) is not None:
                self.poll.unregister(s.fileno())
            del self.sock[s.fileno()], self.peer[s], self.outbox[s]
            self.eof.discard(s)
            s.close()


def main(argv):
    split = argv.index("--")
    setup = dict(arg.split("=", 1) for arg in argv[1:split])
    command = argv[split + 1:]
    listeners = listen(int(setup["port"])) if "relay" in setup else []
    limit({name: int(setup[name]) for name in LIMITS if name in setup})
    drop(int(setup["uid"]) if "uid" in setup else None)
    for sig in (_signal.SIGTERM, _signal.SIGINT):  # a timeout's SIGTERM is for the harness, not for this relay
        _signal.signal(sig, _signal.SIG_IGN)
    pid = start(command)
    if listeners:
        Relay(listeners, setup["relay"]).run_until(os.pidfd_open(pid))
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
