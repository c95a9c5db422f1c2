"""Sandbox benchmark: `python benchmarks/sandbox_startup.py --json [--quick]`.

What it measures:
- start-up: what sandboxing adds to one execution before the harness's own code runs: handing the workspace
  to the execution's uid, opening its relay socket, starting bwrap and `sandbox_init` (which listens on the
  proxy's port, sets the rlimits, drops privileges and execs the harness), and closing the socket after. The
  harness is `/bin/true`, so the wall time is the sandbox's; the same `/bin/true` started unsandboxed is
  reported beside it as the floor of any process start. Both are waited for with a blocking `waitpid`, not
  `GroupProcess`'s polling, whose back-off (1, 2, 4, ... 50 ms) would quantise a 35 ms start-up to 63 ms;
  that polling costs sandboxed and unsandboxed executions alike;
- a toy-agent step: one execution of the bundled toy agent on the `hello` task through the real proxy to the
  local CPU engine (random init, seed 0), scored by the toy grader, run alternately with sandbox = "bwrap"
  and "none" (the evaluator is sandboxed or not along with it); `added_median_ms` is the median of the
  paired differences (the i-th executions of both modes generate the same tokens);
- a Python evaluation: the toy grader as a Python evaluator (`grading.py:evaluate`) scoring a right answer,
  in the execution's sandbox (bwrap + a fresh interpreter running `sandbox_evaluate`) and unsandboxed (a
  child forked from the warm forkserver), alternately.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gyre.harness import EvaluationContext, Execution, HarnessConfig, HarnessRunner, PythonEvaluator, TaskSet
from gyre.harness.bwrap import SandboxSpec, UidPool, check_available, give_to
from gyre.harness.evaluators import load_function
from gyre.harness.relay import ProxyRelay
from gyre.sink import MemorySink

REPO = Path(__file__).resolve().parents[1]
TOY_TASKS = REPO / "tasks" / "toy" / "tasks.toml"
TOY_HARNESS = REPO / "agents" / "toy_agent" / "harness.toml"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary_ms(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(values) * 1000, 1),
            "p99_ms": round(percentile(values, 0.99) * 1000, 1), "n": len(values)}


def start_up(runs: int, base: Path) -> dict[str, object]:
    check_available()
    relay = ProxyRelay("127.0.0.1", 9)
    uids = UidPool.shared() if os.geteuid() == 0 else None
    sandboxed, plain = [], []
    try:
        for i in range(runs):
            workspace = base / f"w{i}"
            workspace.mkdir()
            (workspace / "README.md").write_text("a starting file\n")
            uid = uids.acquire() if uids is not None else None
            began = time.perf_counter()
            give_to(uid, workspace)
            socket_path = relay.open(uid)
            spec = SandboxSpec(workspace=workspace, uid=uid, relay_socket=socket_path, proxy_port=8000)
            done = subprocess.run(spec.argv(["/bin/true"]), cwd=workspace, env={"PATH": os.defpath},
                                  stdin=subprocess.DEVNULL, capture_output=True, start_new_session=True)
            relay.close(socket_path)
            sandboxed.append(time.perf_counter() - began)
            assert done.returncode == 0, done.stderr
            if uids is not None and uid is not None:
                uids.release(uid)
            began = time.perf_counter()
            subprocess.run(["/bin/true"], cwd=workspace, env={"PATH": os.defpath}, stdin=subprocess.DEVNULL,
                           capture_output=True, start_new_session=True)
            plain.append(time.perf_counter() - began)
    finally:
        relay.stop()
    return {"sandboxed": summary_ms(sandboxed), "unsandboxed_true": summary_ms(plain),
            "added_median_ms": round((statistics.median(sandboxed) - statistics.median(plain)) * 1000, 1)}


def toy_steps(runs: int, base: Path) -> dict[str, object]:
    """Each mode has its own engine (seed 0) and proxy, so both see the same sequence of request seeds: the
    i-th execution of each mode generates the same tokens and does the same work, and the modes alternate so
    that both share the machine's load alike."""
    from gyre.engine.local import LocalEngine, LocalEngineConfig, LocalEngineServer
    from gyre.proxy import Proxy, ProxyConfig, ProxyServer

    task = TaskSet.load(TOY_TASKS)["hello"]
    harness = HarnessConfig.load(TOY_HARNESS)
    modes = ("bwrap", "none")
    engines = {m: LocalEngineServer(LocalEngine(LocalEngineConfig(seed=0, num_threads=1))) for m in modes}
    servers = {}
    for mode in modes:
        engines[mode].start()
        servers[mode] = ProxyServer(Proxy(ProxyConfig(engines={"cell0": engines[mode].url}), sink=MemorySink()))
        servers[mode].start()
    times: dict[str, list[float]] = {m: [] for m in modes}
    statuses: dict[str, list[str]] = {m: [] for m in modes}
    runners = {m: HarnessRunner(harness.model_copy(update={"sandbox": m}), sink=MemorySink(),
                                proxy_url=servers[m].url, root=base / m) for m in modes}
    try:
        for i in range(-1, runs):  # one warm-up round, not counted
            for mode, runner in runners.items():
                eid = f"{mode}-{i + 1}"
                token = servers[mode].register_execution(eid, None).token
                began = time.perf_counter()
                result = runner.run(Execution(eid, task, "g", token=token, cell_id="cell0"))
                if i >= 0:
                    times[mode].append(time.perf_counter() - began)
                    statuses[mode].append(result.status)
    finally:
        for runner in runners.values():
            runner.close()
        for mode in modes:
            servers[mode].stop()
            engines[mode].stop()
    paired = [a - b for a, b in zip(times["bwrap"], times["none"], strict=True)]
    return {m: summary_ms(times[m]) | {"statuses": sorted(set(statuses[m]))} for m in modes} | {
        "added_median_ms": round(statistics.median(paired) * 1000, 1)}


def python_evaluations(runs: int, base: Path) -> dict[str, object]:
    task = TaskSet.load(TOY_TASKS)["hello"]
    evaluator = PythonEvaluator(load_function("grading.py:evaluate", TOY_TASKS.parent), name="toy-grader",
                                taskset_dir=TOY_TASKS.parent)
    uids = UidPool.shared() if os.geteuid() == 0 else None
    uid = uids.acquire() if uids is not None else None
    workspace = base / "workspace"
    workspace.mkdir()
    (workspace / task.spec.answer_file).write_text(str(task.spec.grading["expected"]))
    give_to(uid, workspace)
    times: dict[str, list[float]] = {"bwrap": [], "none": []}
    for i in range(-1, runs):  # one warm-up round (the forkserver starts), not counted
        for mode in times:
            sandbox = SandboxSpec(workspace=workspace, uid=uid) if mode == "bwrap" else None
            context = EvaluationContext(f"e{i}", task.spec, workspace, base / f"{mode}-{i + 1}", sandbox=sandbox)
            began = time.perf_counter()
            outcome = evaluator.evaluate(context)
            if i >= 0:
                times[mode].append(time.perf_counter() - began)
            assert getattr(outcome, "reward", None) == 1.0, outcome
    if uids is not None and uid is not None:
        uids.release(uid)
    return {m: summary_ms(t) for m, t in times.items()} | {
        "added_median_ms": round((statistics.median(times["bwrap"]) - statistics.median(times["none"])) * 1000, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="fewer runs (a smoke check)")
    parser.add_argument("--starts", type=int, default=200)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--evaluations", type=int, default=40)
    args = parser.parse_args()
    starts, steps, evaluations = (20, 2, 5) if args.quick else (args.starts, args.steps, args.evaluations)
    with tempfile.TemporaryDirectory(prefix="gyre-sandbox-bench-") as tmp:
        base = Path(tmp)
        (base / "starts").mkdir()
        (base / "evaluations").mkdir()
        result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
                  "python": sys.version.split()[0], "start_up": start_up(starts, base / "starts"),
                  "python_evaluation": python_evaluations(evaluations, base / "evaluations"),
                  "toy_agent_step": toy_steps(steps, base)}
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
