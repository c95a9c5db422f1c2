"""The log benchmark's measurements run end to end at tiny sizes and report what `gyre log bench` promises
(the figures themselves belong to docs/benchmarks.md, not to tests)."""

from pathlib import Path

from benchmarks import log_bench


def test_payload_modes_measure_the_same_bytes_as_their_raw_baseline(tmp_path: Path) -> None:
    out = log_bench.payload_efficiency(tmp_path, commits=8, calls_per_commit=2, rounds=1)
    for label, (producers, wait) in log_bench.PAYLOAD_MODES.items():
        assert out[f"payload_efficiency{label}"] > 0
        assert out[f"payload_producers{label}"] == producers and out[f"payload_commits_wait{label}"] == wait
        # A commit carries at least one append (2 calls of 2,048 tokens), and at most all eight of them.
        one_append = 2 * log_bench.TOKENS_PER_CALL * 8
        assert one_append <= out[f"payload_bytes_per_fsync{label}"] <= 8 * one_append * 1.2  # + framing
    assert out["payload_bytes_per_fsync_single_producer"] < 2 * 2 * log_bench.TOKENS_PER_CALL * 8  # one each
    assert not list(tmp_path.iterdir())  # every round cleans up its files


def test_the_other_figures_run_at_tiny_sizes(tmp_path: Path) -> None:
    assert log_bench.batch_events_per_s(tmp_path, batches=2, rows=1000) > 0
    speedup = log_bench.event_api_speedup(tmp_path, n=400, per_commit=100, rounds=1)
    assert speedup["event_api_speedup"] > 0
    latency = log_bench.commit_latency(tmp_path, producers=4, commits_each=3)
    assert 0 < latency["commit_p50_ms"] <= latency["commit_p99_ms"]
    replay = log_bench.replay_speed(tmp_path, executions=5, calls=4)
    assert replay["replay_events_per_s"] == replay["replay_executions_events_per_s"] > 0
    small = log_bench.replay_small_frames(tmp_path, executions=2, calls=3)
    assert small["replay_small_frames_events"] == 2 * (3 + 2 * 3) and small["replay_small_frames_events_per_s"] > 0
    recovery = log_bench.recovery_speed(tmp_path, megabytes=1)
    assert recovery["recovery_bytes"] > 1 << 20
