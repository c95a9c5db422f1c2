"""What the GSPO sequence ratio means on a tree whose shared tokens are trained once.

A unit is the set of policy tokens one kept trajectory trains: the suffix of its path after the deepest
point where it leaves a higher-ranked kept trajectory. Its ratio is the length-normalised likelihood ratio of
that suffix given everything before it. A shared token counts in the ratio of the trajectory that trains it,
and in no other.
"""

import math

import pytest
import torch
from trainer_trees import micro_batches

from gyre.events import ModelCallFinished
from gyre.model import build_tiny_model
from gyre.trainer import TorchBackend, TorchBackendConfig, TrainBatch
from gyre.trainer.loss import sequence_log_ratios
from gyre.trajectory import ExecutionCalls, ExecutionOutcome, Group, Member

BEHAVIOUR = {10: -5.0, 11: -5.5, 12: -6.0, 20: -5.2, 21: -4.9, 30: -5.7}


def call(call_id, parent, prefix, delta, out, logprobs=None, execution="e1"):
    return ModelCallFinished(
        execution_id=execution, call_id=call_id, cell_id="c", parent_call_id=parent, branch="main",
        prefix_len=prefix, prompt_delta_ids=delta, output_ids=out,
        output_logprobs=[(logprobs or BEHAVIOUR)[t] for t in out], policy_version=0,
    )


def group(logprobs=None) -> Group:
    """e1: a reply (10 11 12), then two continuations of it: (4 -> 20 21) and, as a retry, (5 -> 30)."""
    tree = ExecutionCalls.from_events([
        call("c0", None, 0, [1, 2, 3], [10, 11, 12], logprobs),
        call("c1", "c0", 6, [4], [20, 21], logprobs),
        call("c2", "c0", 6, [5], [30], logprobs),
    ])
    other = ExecutionCalls.from_events([call("d0", None, 0, [1, 2], [10, 11], execution="e2")])
    members = tuple(
        Member(ExecutionOutcome(execution_id=e, group_id="g", task_id="t", status="completed", reward=r, calls=1), c)
        for e, r, c in (("e1", 1.0, tree), ("e2", 0.0, other))
    )
    return Group("g", members)


def unit_ratios(form: str, logprobs=None) -> dict[tuple[str, int], tuple[list[int], float]]:
    """(execution, rank) -> (trained token ids, log s) under the tiny model."""
    batch = TrainBatch.from_micro_batch(micro_batches([group(logprobs)], form)[0])
    backend = TorchBackend(build_tiny_model(0), TorchBackendConfig(dtype="float64"))
    lp = backend.logprobs(batch)
    log_s = sequence_log_ratios(lp - batch.behaviour_logprobs.double(), batch.unit_ids, batch.num_units)
    tokens: dict[int, list[int]] = {}
    for i, u in enumerate(batch.unit_ids.tolist()):
        tokens.setdefault(u, []).append(int(batch.input_ids[batch.trained[i]]))
    return {batch.units[u]: (tokens[u], float(log_s[u])) for u in tokens}


def model_logprob(path: list[int], index: int) -> float:
    model = build_tiny_model(0).double()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([path])).logits[0]
    return float(torch.log_softmax(logits[index - 1], -1)[path[index]])


@pytest.mark.parametrize("form", ["packed", "expanded"])
def test_each_kept_trajectory_has_the_ratio_of_the_tokens_it_trains(form):
    ratios = unit_ratios(form)
    main, retry = ratios[("e1", 0)], ratios[("e1", 1)]
    assert main[0] == [10, 11, 12, 20, 21]  # the longer continuation ranks first and trains the shared reply
    assert retry[0] == [30]  # the retry trains only its own suffix
    main_path, retry_path = [1, 2, 3, 10, 11, 12, 4, 20, 21], [1, 2, 3, 10, 11, 12, 5, 30]
    expected_main = sum(model_logprob(main_path, i) - BEHAVIOUR[main_path[i]] for i in (3, 4, 5, 7, 8)) / 5
    expected_retry = model_logprob(retry_path, 7) - BEHAVIOUR[30]  # conditioned on the shared prefix
    assert main[1] == pytest.approx(expected_main, abs=1e-6)
    assert retry[1] == pytest.approx(expected_retry, abs=1e-6)


def test_a_shared_token_moves_only_the_ratio_of_its_owner():
    before = unit_ratios("packed")
    shifted = unit_ratios("packed", {**BEHAVIOUR, 11: BEHAVIOUR[11] - 0.5})
    assert shifted[("e1", 0)][1] == pytest.approx(before[("e1", 0)][1] + 0.5 / 5, abs=1e-9)
    assert shifted[("e1", 1)][1] == pytest.approx(before[("e1", 1)][1], abs=1e-12)
    assert math.isfinite(shifted[("e1", 1)][1])


def test_both_forms_define_the_same_ratios():
    packed, expanded = unit_ratios("packed"), unit_ratios("expanded")
    assert packed.keys() == expanded.keys()
    for key in packed:
        assert packed[key][0] == expanded[key][0]
        assert packed[key][1] == pytest.approx(expanded[key][1], abs=1e-6)
