"""The run host's progress phases as console lines, for both CLIs (`gyre train`, `gyre run`).

Each CLI draws its topology's own phases (a single cell's rollout counts; a cluster's roles, losses and
switches) and hands the rest here, so a phase the host reports reads the same in both.
"""

from rich.console import Console


def print_phase(console: Console, phase: str, figures: dict) -> bool:
    """Print a host phase; False when ``phase`` is not one (the caller's own)."""
    if phase == "step":
        record = figures["record"]
        reward = "n/a" if record.reward_mean is None else f"{record.reward_mean:.3f}"
        tokens_per_s = record.trained_tokens / record.train_s if record.train_s else 0.0
        console.print(f"step {record.step}: reward mean {reward} over {record.scored}/{record.executions} scored, "
                      f"{record.micro_steps} micro-steps, {record.forwarded_tokens} forwarded / "
                      f"{record.trained_tokens} trained tokens ({tokens_per_s:.0f}/s), "
                      f"rollout {record.rollout_s:.1f}s, train {record.train_s:.1f}s, "
                      f"policy v{record.policy_version} -> v{record.policy_version + int(record.micro_steps > 0)}, "
                      f"at {record.wall_s:.0f}s",
                      overflow="fold")
    elif phase == "rollout":
        console.print(f"[dim]step {figures['step']}: {figures['queued']} executions queued on policy "
                      f"v{figures['version']}[/dim]")
    elif phase == "heldout":
        event = figures["event"]
        rate = "n/a" if event.pass_rate is None else f"{event.pass_rate:.0%}"
        console.print(f"held-out after {event.step} steps: pass rate {rate} ({event.passed}/{event.scored}) on "
                      f"policy v{event.policy_version}")
    elif phase == "heldout-redo":
        console.print(f"[yellow]held-out after {figures['step']} steps: cut by the crash, run again[/yellow] "
                      f"({figures['unscored']} executions not yet scored)")
    elif phase == "heldout-lost":
        steps = ", ".join(map(str, figures["steps"]))
        console.print(f"[yellow]held-out after {steps} steps: cut by a crash; that policy is no longer served, so "
                      "it is not measured[/yellow]")
    elif phase == "resubmitted":
        console.print(f"[yellow]{figures['executions']} executions queued again[/yellow] (their harnesses were "
                      "lost before they were scored)")
    elif phase == "skipped":
        console.print(f"[yellow]step {figures['step']}: not trained: {figures['reason']}[/yellow]")
    elif phase == "report":
        console.print(f"report: {figures['path']}")
    else:
        return False
    return True
