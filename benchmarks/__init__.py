"""Benchmarks: each prints one JSON object; results and commands are recorded in docs/benchmarks.md."""
