"""Drawing one execution's call tree in the terminal.

A main agent has hundreds of calls, so straight chains (each call continued at its end by exactly one
call of the same branch) are drawn as one node; the tree shows only where the run branches: retries,
compactions, sub-agents. Trajectory ends carry their fate: kept (with rank and tokens trained), capped,
or redundant.
"""

import numpy as np
from rich.tree import Tree

from gyre.trajectory.calls import BRANCHES
from gyre.trajectory.rewards import ExecutionOutcome
from gyre.trajectory.selection import Selection

_STYLE = {"main": "bold cyan", "main-summary": "cyan", "sub-agent": "magenta", "sub-agent-summary": "dim magenta"}


def render(selection: Selection, outcome: ExecutionOutcome | None = None) -> Tree:
    """A rich tree of ``selection``'s execution with chains collapsed and trajectory fates marked."""
    tree, calls = selection.tree, selection.tree.calls
    fate: dict[int, str] = {}
    for rank, end in enumerate(selection.kept.tolist()):
        fate[end] = f"[green]★ kept #{rank}, trains {int(selection.trained[rank]):,} tokens[/]"
    for end in selection.capped_ends.tolist():
        fate[end] = "[yellow]✗ capped[/]"
    for end in selection.redundant_ends.tolist():
        fate[end] = "[dim]· redundant (all its policy tokens trained elsewhere)[/]"
    children: dict[int, list[int]] = {}
    for call in np.argsort(calls.seq, kind="stable").tolist():
        children.setdefault(int(tree.owner[call]), []).append(call)
    root = Tree(_title(selection, outcome))
    for call in children.get(-1, []):
        _add(root, call, selection, children, fate)
    return root


def _title(selection: Selection, outcome: ExecutionOutcome | None) -> str:
    calls = selection.tree.calls
    parts = [f"[bold]{calls.execution_id}[/]"]
    if outcome is not None:
        parts.append(f"group {outcome.group_id}")
        if outcome.reward is not None:
            parts.append(f"reward {outcome.reward:.3f}" + (" (partial: timed out)" if outcome.partial else ""))
        elif outcome.eval_error is not None:
            parts.append(f"[red]evaluation failed: {outcome.eval_error}[/]")
        parts.append(f"status {outcome.status or 'running'}")
    parts += [
        f"{calls.n} calls",
        f"{calls.num_tokens:,} tokens ({calls.num_policy_tokens:,} policy)",
        f"{selection.trajectories} trajectories, {len(selection.kept)} kept",
        f"packed {selection.tokens_packed:,} vs expanded {selection.tokens_expanded:,} forward tokens",
    ]
    return " · ".join(parts)


def _add(parent: Tree, call: int, selection: Selection, children: dict[int, list[int]], fate: dict[int, str]) -> None:
    tree, calls = selection.tree, selection.tree.calls
    chain = [call]
    while True:
        node = chain[-1]
        kids = children.get(node, [])
        if len(kids) != 1 or node in fate:
            break
        kid = kids[0]
        if tree.attach[kid] != calls.seg_len[node] - 1 or calls.branch[kid] != calls.branch[node]:
            break
        chain.append(kid)
    first, last = chain[0], chain[-1]
    branch = BRANCHES[calls.branch[first]]
    context = int(calls.delta_len[chain].sum())
    policy = int(calls.seg_len[chain].sum()) - context
    ids = calls.call_ids[first] if len(chain) == 1 else f"{calls.call_ids[first]} … {calls.call_ids[last]}"
    where = ""
    if tree.owner[first] >= 0 and tree.attach[first] != calls.seg_len[tree.owner[first]] - 1:
        where = f" [dim](branches off at token {int(tree.attach[first])} of {calls.call_ids[tree.owner[first]]})[/]"
    versions = sorted(set(calls.version[chain].tolist()))
    label = (
        f"[{_STYLE[branch]}]{branch}[/] ×{len(chain)} {ids} · {context:,} context + {policy:,} policy tokens · "
        f"v{'/'.join(map(str, versions))}{where}"
    )
    if last in fate:
        label += f"  {fate[last]}"
    node = parent.add(label)
    for kid in children.get(last, []):
        _add(node, kid, selection, children, fate)
