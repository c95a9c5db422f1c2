"""Offline replay of scheduling decisions: exact (``replay_decisions``) and counterfactual (``retime``)."""

from gyre.replay.counterfactual import retime, retime_run, workload_from_log
from gyre.replay.exact import Mismatch, ReplayError, ReplayReport, replay_decisions

__all__ = ["Mismatch", "ReplayError", "ReplayReport", "replay_decisions", "retime", "retime_run", "workload_from_log"]
