"""Weights pull over Mooncake (`gyre.transfer.tensors.pull_weights`, checksums verified) against a raw loopback
TCP stream of the same bytes, in the same run, rounds alternating.

    .venv/bin/python benchmarks/weights_pull_bench.py [--mib 256] [--rounds 5] [--json]

The publisher (a `WeightsPublisher` with the weights, and a plain socket server sending the same bytes) is a
spawned process; this process pulls. Reported: MB/s of each method per round, the medians, and their ratio.
A third figure, the bare Mooncake batched read of the same spans without the header checks and checksums,
shows what verification costs; `pull_fresh_buffer` is the one-shot `pull_weights` (allocates and registers
a buffer per pull), `pull` a `WeightsPuller` (one registered buffer kept across pulls, as satellites do),
`pull_no_checksum` the same with `verify=False` (header check only).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import threading
import time
from typing import Any

MIB = 1 << 20


def publisher(mib: int, conn: Any) -> None:
    import torch

    from gyre.transfer import TransferEndpoint
    from gyre.transfer.tensors import WeightsPublisher

    endpoint = TransferEndpoint()
    tensors = {f"layers.{i}.weight": torch.randn(16 * MIB // 4) for i in range(mib // 16)}
    manifest = WeightsPublisher(endpoint).publish(1, tensors)
    payload = b"".join(t.numpy().tobytes() for t in tensors.values())
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)

    def serve() -> None:
        while True:
            client, _ = server.accept()
            client.sendall(payload)
            client.close()

    threading.Thread(target=serve, daemon=True).start()
    conn.send((endpoint.session_id, manifest.to_json(), server.getsockname()[1], len(payload)))
    conn.recv()  # until the benchmark is over


def tcp_pull(port: int, nbytes: int) -> float:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        got = 0
        while got < nbytes:
            n = s.recv_into(view[got:], min(4 * MIB, nbytes - got))
            if n == 0:
                raise RuntimeError(f"the stream ended after {got} of {nbytes} bytes")
            got += n
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch

    from gyre.transfer import Span, TransferEndpoint
    from gyre.transfer.tensors import TensorManifest, WeightsPuller, pull_weights

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=publisher, args=(args.mib, child), daemon=True)
    proc.start()
    session, manifest_json, port, nbytes = parent.recv()
    manifest = TensorManifest.from_json(manifest_json)
    endpoint = TransferEndpoint()
    scratch = torch.empty(manifest.total_bytes, dtype=torch.uint8)
    region = endpoint.register_tensor(scratch)
    rows: list[dict[str, float]] = []
    try:
        puller = WeightsPuller(endpoint)
        puller.pull(session, manifest)  # connection set-up and the buffer, once
        for _ in range(args.rounds):
            started = time.perf_counter()
            puller.pull(session, manifest)
            pull_s = time.perf_counter() - started
            started = time.perf_counter()
            pull_weights(endpoint, session, manifest)
            fresh_s = time.perf_counter() - started
            started = time.perf_counter()
            puller.pull(session, manifest, verify=False)
            header_s = time.perf_counter() - started
            tcp_s = tcp_pull(port, nbytes)
            base = scratch.data_ptr()
            stats = endpoint.read(session, [Span(base + o, n) for o, n in manifest.chunks()],
                                  [Span(manifest.addr + o, n) for o, n in manifest.chunks()])
            rows.append({"pull_MBps": manifest.total_bytes / pull_s / 1e6,
                         "pull_fresh_buffer_MBps": manifest.total_bytes / fresh_s / 1e6,
                         "pull_no_checksum_MBps": manifest.total_bytes / header_s / 1e6,
                         "tcp_MBps": nbytes / tcp_s / 1e6,
                         "raw_read_MBps": stats.bytes / stats.seconds / 1e6})
    finally:
        endpoint.unregister(region)
        parent.send("done")
        proc.join(10)
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    report = {"mib": args.mib, "rounds": rows, "median": medians,
              "pull_vs_tcp": medians["pull_MBps"] / medians["tcp_MBps"]}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in rows:
            print("  ".join(f"{k} {v:8.0f}" for k, v in r.items()))
        print(f"median: pull {medians['pull_MBps']:.0f} MB/s (fresh buffer {medians['pull_fresh_buffer_MBps']:.0f}),"
              f" raw Mooncake read {medians['raw_read_MBps']:.0f} MB/s,"
              f" TCP stream {medians['tcp_MBps']:.0f} MB/s; pull / TCP = {report['pull_vs_tcp']:.2f}")


if __name__ == "__main__":
    main()
