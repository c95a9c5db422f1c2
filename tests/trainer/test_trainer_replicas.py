"""Two replicas in two processes (core + satellite, gradients summed over gloo) against one replica that
processes the same micro-steps: same updated weights, and the log says who did what."""

import pytest
import torch
from safetensors.torch import load_file
from trainer_trees import micro_batches, random_group

from gyre.log import LogReader
from gyre.model import save_tiny
from gyre.state import TrainerView, replay
from gyre.trainer import GSPOConfig, OptimizerConfig, ReplicaRun, TorchBackendConfig, run_replicas

STEPS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    model_dir = save_tiny(root / "model")
    groups = [random_group(seed, executions=3, calls=10, group_id=f"g{seed}") for seed in range(3)]
    step = tuple(micro_batches(groups, "packed", token_budget=120))
    config = TorchBackendConfig(
        optimizer=OptimizerConfig(lr=1e-3), loss=GSPOConfig(eps_low=0.5, eps_high=0.5, tis_cap=None)
    )

    def make(name: str) -> ReplicaRun:
        return ReplicaRun(model_dir=model_dir, log_dir=root / name / "log", out_dir=root / name, backend=config,
                          steps=(step,) * STEPS, ready_interval_s=0.05, timeout_s=240)

    two, one = make("two"), make("one")
    run_replicas(two, satellites=1)
    run_replicas(one, satellites=0)
    return two, one, len(step)


def test_two_replicas_update_the_weights_as_one_does(runs):
    two, one, _ = runs
    core, satellite = load_file(str(two.weights_path("core"))), load_file(str(two.weights_path("satellite-1")))
    single = load_file(str(one.weights_path("core")))
    from gyre.model import build_tiny_model

    initial = dict(build_tiny_model(0).named_parameters())
    assert max(float((core[n] - initial[n].detach()).abs().max()) for n in core) > 1e-4  # it trained
    assert max(float((core[n] - single[n]).abs().max()) for n in core) < 1e-5
    assert all(torch.equal(core[n], satellite[n]) for n in core)  # the satellite holds the published weights


def test_the_events_say_who_did_what(runs):
    two, _, planned = runs
    events = list(LogReader(two.log_dir).events())
    kinds = [e.kind for e in events]
    assert kinds[0] == "satellite_joined" and kinds[-1] == "satellite_left"
    assert kinds.count("train_step_finished") == kinds.count("weights_published") == STEPS
    claims = [e for e in events if e.kind == "micro_step_claimed"]
    finishes = [e for e in events if e.kind == "micro_step_finished"]
    assert len(claims) == len(finishes) == planned * STEPS
    assert {(e.step, e.micro_step): e.cell_id for e in claims} == {(e.step, e.micro_step): e.cell_id for e in finishes}
    assert {e.cell_id for e in claims} == {"core", "satellite-1"}
    for step in range(STEPS):
        closed = next(i for i, e in enumerate(events) if e.kind == "train_step_finished" and e.step == step)
        published = next(
            i for i, e in enumerate(events) if e.kind == "weights_published" and e.policy_version == step + 1
        )
        assert all(i < closed for i, e in enumerate(events) if e.kind == "micro_step_finished" and e.step == step)
        assert closed < published
        assert events[closed].policy_version == step + 1
    state, _ = replay(TrainerView(), two.log_dir)
    assert state.policy_version == state.published_version == STEPS
    assert all(s.closed and not s.pending for s in state.steps.values())
    assert state.satellites == set()


def test_a_single_replica_logs_the_same_steps(runs):
    _, one, planned = runs
    state, _ = replay(TrainerView(), one.log_dir)
    assert state.policy_version == STEPS
    assert all(set(s.claimed.values()) == {"core"} and len(s.finished) == planned for s in state.steps.values())
