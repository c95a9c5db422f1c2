"""The control-plane benchmark's machinery at a tiny size: the real controller against three stand-in cells and
a stand-in proxy over gRPC (the figures themselves belong to docs/benchmarks.md, not to tests)."""

from pathlib import Path

import pytest

from benchmarks import control_plane_bench as cpb


@pytest.mark.integration  # a controller and two stand-in processes over gRPC, ~10 s each
@pytest.mark.parametrize("one_stream", [False, True], ids=["lanes", "one-stream"])
def test_a_tiny_run_measures_every_figure(one_stream: bool) -> None:
    scenario = cpb.Scenario(cells=3, slots=2, call_interval_s=0.4, call_s=0.1, calls_mean=2, prompt_delta_tokens=50,
                            output_tokens=20, heartbeat_s=0.5, train_s=0.05, warmup_s=1.5, duration_s=3.0,
                            cell_processes=2, proxy_one_stream=one_stream)
    result = cpb.measure(scenario)
    assert result["cells"] == 3 and result["window_s"] >= 3.0
    kinds = result["events_by_kind"]
    assert kinds["model_call_started"] > 0 and kinds["model_call_finished"] > 0  # the workload reached the log
    assert result["events_per_s"] >= sum(kinds.values()) / result["window_s"] * 0.99
    assert result["log_mb_per_s"] > 0 and result["controller_rss_mb"] > 0 and result["controller_cpu_cores"] > 0
    assert result["tick_ms"]["n"] > 0 and result["fold_ms"]["n"] > 0 and result["policy_decide_ms"]["n"] > 0
    assert "gyre-hub" in result["controller_cpu_cores_by_thread"] or result["hub_loop_lag_ms"]["n"] > 0
    standins = result["standins"]
    assert standins["proxy"]["calls_finished"] >= kinds["model_call_finished"]
    assert standins["cells"]["stop"] == 3  # every cell stand-in was told to stop, and reported back
    assert len(standins["cells"]["processes"]) == 2  # three cells over two processes
    assert standins["proxy"]["loop_lag_ms"]["n"] > 0
    sent, lane = standins["proxy"]["sent"], standins["proxy"]["sent_commands_lane"]
    # the proxy's dones go up its commands lane, its events up the other (one stream: both there)
    assert (sent.get("done", 0) > 0, lane.get("done", 0) > 0) == (one_stream, not one_stream)
    assert sent["events"] > 0 and "events" not in lane
    parts = result["command_parts_ms_by_kind"]
    assert set(parts) == set(result["command_rtt_ms_by_kind"])  # every command timed was cut into its parts
    proxy_parts = {*cpb.PARTS, "events_wait", "turn_wait",  # the proxy's waits to send its events, for its turn,
                   "up_to_loop", "up_queue", "up_wire"}  # and its up part cut at its link's loop and its write
    assert result["hub_ingest_ms_by_peer"]["proxy"]["wall"]["p50"] > 0  # the hub's ingest of the proxy's batches
    for kind, by_part in parts.items():
        assert set(by_part) == (proxy_parts if kind in cpb.PROXY_KINDS else set(cpb.PARTS)), kind
        assert all(values["p50"] >= 0 for values in by_part.values()), (kind, by_part)  # stamps in order


def test_the_profile_summary_groups_threads_and_counts_self_and_total(tmp_path: Path) -> None:
    collapsed = tmp_path / "stacks.txt"
    collapsed.write_text("thread (1): gyre-hub;run (a.py:1);decode (b.py:2) 3\n"
                         "thread (1): gyre-hub;run (a.py:1) 1\n"
                         "thread (7): gyre-cell-c0;wait (t.py:9) 2\n"
                         "thread (8): gyre-cell-c1;wait (t.py:9) 2\n")
    summary = cpb._profile_summary(collapsed)
    assert summary["gyre-hub"]["samples"] == 4
    assert summary["gyre-hub"]["self_pct"][0] == ["decode (b.py:2)", 75.0]
    assert ["run (a.py:1)", 100.0] in summary["gyre-hub"]["total_pct"]
    assert summary["gyre-cell-*"] == {"samples": 4, "self_pct": [["wait (t.py:9)", 100.0]],
                                      "total_pct": [["wait (t.py:9)", 100.0]]}
