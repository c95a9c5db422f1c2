"""Held-out evaluation of the current policy during training (``heldout_evaluated`` events)."""

from gyre.evaluation.heldout import GROUP_PREFIX, HeldOutPlan, heldout_executions, plan_heldout, summarize

__all__ = ["GROUP_PREFIX", "HeldOutPlan", "heldout_executions", "plan_heldout", "summarize"]
