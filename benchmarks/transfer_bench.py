"""Mooncake transfer benchmark (issue 12's weight pull): `python -m benchmarks.transfer_bench [--quick] [--sweep]`.

What it measures: pulling a fixed 256 MiB of registered memory from a peer process's `TransferEndpoint`
with batched reads (`TransferEndpoint.read`, Mooncake Transfer Engine over loopback TCP), against a raw
loopback TCP stream of the same bytes from the same peer process into the same local buffer (one
`sendall` there, `recv_into` here: what a plain socket can do on this machine). Paths alternate within each
round (the order reverses every other round) and medians are kept; the ratio is median raw seconds over
median Mooncake seconds. Each Mooncake path's bytes are checked once (CRC32 against the peer's).

Paths (`--paths`):
- `read` - the headline: `--spans` spans (64 x 4 MiB: a weight set of 4 MiB tensors) with the endpoint's
  default wait (`sleep`: async batches polled with sleeps);
- `read_spin` - the same spans through Mooncake's `batch_transfer_sync_read`, which polls without pausing
  (`EndpointConfig(wait="spin")`): the evidence for why the endpoint does not use it;
- `read_1span` - one 256 MiB span (one connection lane); `read_1024spans` - 1024 x 256 KiB (per-span cost);
- `read_register` - register the local buffer, read, unregister, timed together (registration per pull);
- `write` - the same spans written into the peer (the KV path's direction).
`--sweep` repeats `read` in child processes with Mooncake's TCP settings changed (`MC_TCP_SLICE_SIZE`,
`MC_TCP_LANES_PER_PEER`; read once per process, so they need fresh processes on both sides).
Goal (issue 12): `read` >= 0.9 x raw TCP.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import zlib
from typing import Any

import torch

from gyre.transfer import EndpointConfig, Span, TransferEndpoint

MIB = 1 << 20
GOAL = 0.9
PATHS = ("read", "read_spin", "read_1span", "read_1024spans", "read_register", "write")
SWEEP = (
    {"MC_TCP_SLICE_SIZE": "16384"},
    {"MC_TCP_SLICE_SIZE": "262144"},
    {"MC_TCP_SLICE_SIZE": "1048576"},
    {"MC_TCP_SLICE_SIZE": "4194304"},
    {"MC_TCP_LANES_PER_PEER": "1"},
    {"MC_TCP_LANES_PER_PEER": "8"},
)


def _peer(nbytes: int, info: Any, stop: Any) -> None:
    """The peer: `nbytes` of seeded random bytes, registered with Mooncake and served raw on a socket."""
    endpoint = TransferEndpoint()
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(12))
    endpoint.register_tensor(buf)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = memoryview(buf.numpy())
        while True:
            header = conn.recv(8, socket.MSG_WAITALL)
            if len(header) < 8:
                return
            (n,) = struct.unpack("!Q", header)
            conn.sendall(payload[:n])

    threading.Thread(target=serve, daemon=True).start()
    info.put((endpoint.session_id, buf.data_ptr(), srv.getsockname()[1], zlib.crc32(buf.numpy())))
    stop.wait()


def _spans(local: int, remote: int, nbytes: int, count: int) -> tuple[list[Span], list[Span]]:
    size = nbytes // count
    return ([Span(local + i * size, size) for i in range(count)],
            [Span(remote + i * size, size) for i in range(count)])


def run(mib: int = 256, rounds: int = 7, spans: int = 64, paths: tuple[str, ...] = PATHS) -> dict[str, Any]:
    nbytes = mib * MIB
    ctx = mp.get_context("spawn")
    info, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_peer, args=(nbytes, info, stop), daemon=True)
    proc.start()
    load_before = os.getloadavg()[0]
    try:
        session, remote, port, crc = info.get(timeout=120)
        sleep_ep, spin_ep = TransferEndpoint(), TransferEndpoint(EndpointConfig(wait="spin"))
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        view = memoryview(dst.numpy())
        regions = {ep: ep.register_tensor(dst) for ep in (sleep_ep, spin_ep)}
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        base = dst.data_ptr()

        def raw() -> float:
            start = time.perf_counter()
            sock.sendall(struct.pack("!Q", nbytes))
            got = 0
            while got < nbytes:
                got += sock.recv_into(view[got:], nbytes - got)
            return time.perf_counter() - start

        def mooncake(path: str) -> float:
            count = {"read_1span": 1, "read_1024spans": 1024}.get(path, spans)
            local, far = _spans(base, remote, nbytes, count)
            if path == "read_register":  # a fresh registration on an endpoint that holds none of dst
                start = time.perf_counter()
                sleep_ep.unregister(regions[sleep_ep])
                regions[sleep_ep] = sleep_ep.register_tensor(dst)
                sleep_ep.read(session, local, far)
                return time.perf_counter() - start
            if path == "write":
                return sleep_ep.write(session, local, far).seconds
            return (spin_ep if path == "read_spin" else sleep_ep).read(session, local, far).seconds

        verified: dict[str, bool] = {}
        for path in paths:  # warm-up (connections, lanes) and the byte check, outside the figures
            if path != "write":
                dst.zero_()
                mooncake(path)
                verified[path] = zlib.crc32(dst.numpy()) == crc
        raw()
        mooncake("write")
        rows: dict[str, list[float]] = {p: [] for p in ("raw", *paths)}
        for r in range(rounds):
            order = ["raw", *paths]
            for path in order if r % 2 == 0 else order[::-1]:
                rows[path].append(raw() if path == "raw" else mooncake(path))
        sock.close()
        for ep, region in regions.items():
            ep.unregister(region)
    finally:
        stop.set()
        proc.join(30)
    med = {p: statistics.median(v) for p, v in rows.items()}
    out: dict[str, Any] = {
        "benchmark": "transfer",
        "what": f"pull {mib} MiB of registered memory from a peer process (Mooncake TE, TCP, 127.0.0.1) vs a "
        "raw loopback TCP stream of the same bytes from the same peer into the same buffer",
        "bytes": nbytes,
        "spans": spans,
        "rounds": rounds,
        "cpus": os.cpu_count(),
        "load_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "mooncake_env": {k: v for k, v in os.environ.items() if k.startswith("MC_")},
        "raw_tcp_gbps": round(nbytes / med["raw"] / 1e9, 3),
        "paths": {
            p: {
                "ms": round(med[p] * 1e3, 2),
                "gbps": round(nbytes / med[p] / 1e9, 3),
                "vs_raw_tcp": round(med["raw"] / med[p], 3),
                "verified": verified.get(p),
            }
            for p in paths
        },
        "rounds_ms": {p: [round(x * 1e3, 1) for x in v] for p, v in rows.items()},
    }
    if "read" in paths:
        out["read_vs_raw_tcp"] = out["paths"]["read"]["vs_raw_tcp"]
        out["goal_met"] = out["read_vs_raw_tcp"] >= GOAL
        out["goal"] = {"read_vs_raw_tcp_min": GOAL}
    return out


def sweep(mib: int, rounds: int, spans: int) -> list[dict[str, Any]]:
    """`read` against raw TCP with each of `SWEEP`'s settings, one child process (and peer) per setting."""
    results = []
    for env in ({}, *SWEEP):
        cmd = [sys.executable, "-m", "benchmarks.transfer_bench", "--mib", str(mib), "--rounds", str(rounds),
               "--spans", str(spans), "--paths", "read"]
        done = subprocess.run(cmd, env={**os.environ, **env, "GLOG_minloglevel": "2"}, capture_output=True,
                              text=True, check=True)
        child = json.loads(done.stdout.strip().splitlines()[-1])
        results.append({"env": env or "defaults", "read_vs_raw_tcp": child["read_vs_raw_tcp"],
                        "read_gbps": child["paths"]["read"]["gbps"], "raw_tcp_gbps": child["raw_tcp_gbps"],
                        "load_1min": child["load_1min"]})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=None, help="default 7 (3 with --quick)")
    parser.add_argument("--spans", type=int, default=64, help="spans of the headline read (equal sizes)")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=None)
    parser.add_argument("--quick", action="store_true", help="3 rounds; read, read_spin only")
    parser.add_argument("--sweep", action="store_true", help="also `read` under other Mooncake TCP settings")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    paths = tuple(args.paths) if args.paths else (("read", "read_spin") if args.quick else PATHS)
    result = run(args.mib, rounds, args.spans, paths)
    if args.sweep:
        result["sweep"] = sweep(args.mib, max(3, rounds // 2), args.spans)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
