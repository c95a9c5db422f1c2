"""Held-out evaluation of the current policy during training (``heldout_evaluated`` events)."""

from gyre.evaluation.heldout import GROUP_PREFIX, HeldOutEvaluator, HeldOutPlan, plan_heldout, summarize

__all__ = ["GROUP_PREFIX", "HeldOutEvaluator", "HeldOutPlan", "plan_heldout", "summarize"]
