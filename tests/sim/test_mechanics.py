"""Mechanics every design gets (#27): an optimizer step sharded over the training cells, and over-sampling
past half a batch with the due rule kept. Off by default, a run is the run it was before them."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.errors import ConfigError
from gyre.scheduler import get_policy
from gyre.scheduler.view import WorkState
from gyre.sim.runner import policy_params, scenario_values, simulate
from gyre.sim.scenario import TrainingSpec, hidden_reshard_share, load_scenario, reshard_share, with_values
from gyre.sim.workload import sample_workload
from gyre.sink import MemorySink

SPEC = TrainingSpec(s_per_mtoken=50, optimizer_s=60, publish_s=60, satellite_join_s=30, gradient_sync_s=1.0)
CELLS = st.frozensets(st.sampled_from(["c1", "c2", "c3", "c4", "c5"])).map(lambda s: s | {"c0"})


@given(contributing=st.integers(1, 64), shards=st.integers(1, 64))
def test_unsharded_optimizer_is_the_old_formula_and_ignores_the_shards(contributing, shards):
    k = contributing
    assert SPEC.optimizer_step_s(k, shards, 0.5) == SPEC.optimizer_s + SPEC.gradient_sync_s * 2 * (k - 1) / k


@given(contributing=st.integers(1, 64), shards=st.integers(1, 63))
def test_sharding_splits_only_the_update_and_never_beats_it_split_evenly(contributing, shards):
    sharded = SPEC.model_copy(update={"shard_optimizer": True})
    one, more = sharded.optimizer_step_s(contributing, shards), sharded.optimizer_step_s(contributing, shards + 1)
    sync = SPEC.optimizer_step_s(contributing) - SPEC.optimizer_s
    assert one == pytest.approx(SPEC.optimizer_s / shards + sync)
    assert more < one <= SPEC.optimizer_step_s(contributing)
    # moving state shards first costs their share of the whole state at the weight pull's rate
    moved = sharded.optimizer_step_s(contributing, shards, 1 / shards) - one
    assert moved == pytest.approx(sharded.optimizer_state_ratio * sharded.satellite_join_s / shards)


@given(before=CELLS, after=CELLS)
def test_reshard_share_is_symmetric_bounded_and_zero_only_when_nothing_changes(before, after):
    share = reshard_share(before, after)
    assert share == reshard_share(after, before)
    assert (share == 0) == (before == after)
    assert 0 <= share <= 1 / min(len(before), len(after))
    assert share in {0.0, 1 / len(before), 1 / len(after)}


@given(before=CELLS, after=CELLS, since=st.dictionaries(st.sampled_from(["c0", "c1", "c2", "c3", "c4", "c5"]),
                                                        st.floats(0, 500)), move_s=st.floats(1, 400))
def test_an_overlapped_reshard_stalls_at_most_as_long_as_a_serial_one_and_nothing_once_hidden(
        before, after, since, move_s):
    """Background moves only take time off: never more than ``reshard_share``, the serial move when no
    time has passed, and nothing once every moving cell had its share's time (#27, round 5)."""
    hidden = hidden_reshard_share(before, after, since, move_s)
    assert 0 <= hidden <= reshard_share(before, after)
    assert hidden_reshard_share(before, after, {}, move_s) == reshard_share(before, after)
    assert hidden_reshard_share(before, after, dict.fromkeys(before | after, move_s), move_s) == 0
    assert hidden_reshard_share(before, after, since, 0.0) == 0


def test_reshard_share_refuses_an_empty_set():
    with pytest.raises(ValueError, match="core"):
        reshard_share(frozenset(), frozenset({"c0"}))


def _optimizer_spans(events) -> list[float]:
    """Per step: seconds from its last micro-step's end to its end (the optimizer step, as the log shows it)."""
    last: dict[int, float] = {}
    spans = []
    for e in events:
        if e.kind == "micro_step_finished":
            last[e.step] = e.ts.timestamp()
        elif e.kind == "train_step_finished":
            spans.append(e.ts.timestamp() - last[e.step])
    return spans


def _run(sc, policy: str, overrides: dict):
    sink = MemorySink()
    result = simulate(sc, policy, sink=sink, workload=sample_workload(sc, sc.seed, 3),
                      params=policy_params(sc, get_policy(policy), overrides))
    return result, sink.events


def test_a_fixed_pool_of_two_training_cells_runs_half_the_update_each_and_never_moves_state():
    """async with 2 training cells on tiny: both join before the first step ends and stay, so every step's
    optimizer is optimizer_s / 2 plus the 2-cell all-reduce, except the first, which moves the satellite's
    shard in (half the state at the weight pull's rate)."""
    sc = with_values(load_scenario("tiny"), {"cluster.cells": 3, "training.gradient_sync_s": 1.0})
    sharded = with_values(sc, {"training.shard_optimizer": True})
    overrides = {"training_cells": 2, "stream_micro_steps": True}
    _, plain_events = _run(sc, "async", overrides)
    fast, events = _run(sharded, "async", overrides)
    t = sc.training
    assert _optimizer_spans(plain_events) == pytest.approx([t.optimizer_s + t.gradient_sync_s] * 3, abs=1e-5)
    first, *rest = _optimizer_spans(events)
    move = t.optimizer_state_ratio * t.satellite_join_s / 2
    assert first == pytest.approx(move + t.optimizer_s / 2 + t.gradient_sync_s, abs=1e-5)
    assert rest == pytest.approx([t.optimizer_s / 2 + t.gradient_sync_s] * 2, abs=1e-5)
    assert fast.hours >= fast.lower_bound_hours


def test_an_overlapped_reshard_hides_the_first_move_behind_the_satellites_micro_steps():
    """The fixed pool above with ``reshard_overlap``: the satellite pulls its shard from when it joined, so
    the first step's optimizer pays only what its micro-steps did not hide; the others are unchanged."""
    sc = with_values(load_scenario("tiny"), {"cluster.cells": 3, "training.gradient_sync_s": 1.0,
                                             "training.shard_optimizer": True})
    overrides = {"training_cells": 2, "stream_micro_steps": True}
    _, serial = _run(sc, "async", overrides)
    _, events = _run(with_values(sc, {"training.reshard_overlap": True}), "async", overrides)
    (first_serial, *rest_serial), (first, *rest) = _optimizer_spans(serial), _optimizer_spans(events)
    t = sc.training
    assert t.optimizer_s / 2 + t.gradient_sync_s - 1e-5 <= first < first_serial
    assert rest == pytest.approx(rest_serial, abs=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("policy, overrides", [
    ("colocate", {"stream_micro_steps": True}), ("elastic", {}), ("async", {"training_cells": 2})])
def test_sharded_runs_stay_above_their_bound_and_train_every_step(policy, overrides, overlap):
    sc = with_values(load_scenario("tiny"), {"training.shard_optimizer": True, "training.reshard_overlap": overlap})
    result, events = _run(sc, policy, overrides)
    assert [e.step for e in events if e.kind == "train_step_finished"] == [0, 1, 2]
    assert result.hours >= result.lower_bound_hours


def tailed(steps: int = 5):
    return with_values(load_scenario("tiny"), {"rollout.stall_task_share": 0.3, "rollout.stall_prob": 1.0,
                                               "rollout.timeout_s": 900.0, "steps": steps})


@pytest.mark.parametrize("policy, staleness", [("colocate", 0), ("async", 1), ("elastic", 1), ("async", 2)])
@pytest.mark.parametrize("oversample", [3, 4])
def test_oversampling_past_half_a_batch_keeps_every_group_within_staleness_plus_one(policy, staleness, oversample):
    """tiny has 4 groups a batch: 3 and 4 over-sampled groups were refused before; every step is still full
    and no group is trained more than staleness + 1 versions after it was first queued."""
    sc = tailed()
    overrides = {"stream_micro_steps": True, "partial_rollouts": True, "oversample_groups": oversample}
    if policy != "colocate":
        overrides["staleness"] = staleness
    result, events = _run(sc, policy, overrides)
    starts = [e for e in events if e.kind == "train_step_started"]
    assert [e.step for e in starts] == [0, 1, 2] and all(e.groups == sc.batch.groups for e in starts)
    assert result.max_group_lag <= result.staleness + 1
    assert result.hours >= result.lower_bound_hours


def test_a_step_keeps_room_for_the_groups_the_next_step_could_not_hold():
    """Step 2 at staleness 0, 2 groups a step: 4 groups first queued at version 2 are due at step 3, two
    more than it holds, so step 2 takes two of them and not a newer group that completed first."""
    work = WorkState(partial_rollouts=True, staleness=0)
    work.group_origin = {"w": (3, 2), "x": (3, 2), "y": (3, 2), "z": (3, 2), "new": (3, 3)}
    work.pool = ["new", "x"]
    take, full = work.assignable(2, groups=2)
    assert take == ["x"] and not full  # "new" would leave 3 due groups for step 3
    work.pool = ["new", "x", "y"]
    take, full = work.assignable(2, groups=2)
    assert take == ["x", "y"] and full
    work.group_origin |= {"w": (3, 3), "z": (3, 3)}  # only 2 due next: no room kept, completion order
    take, _ = work.assignable(2, groups=2)
    assert take == ["new", "x"]


def test_oversampling_more_than_a_batch_is_refused():
    over = load_scenario("tiny").batch.groups + 1
    with pytest.raises(ConfigError, match="at most a batch"):
        with_values(load_scenario("tiny"), {"policy.colocate": {"partial_rollouts": True, "oversample_groups": over}})


def test_the_ablation_sweep_over_sampling_past_half_a_batch_gives_it_to_every_design():
    from gyre.sim.runner import ablation_variants

    sc = load_scenario("seed-2.4t")
    rows = [v for v in ablation_variants(sc, [4, 8, 12, 16]) if v.overrides.get("partial_rollouts")]
    by_design = {(v.role, v.overrides.get("training_cells")): set() for v in rows}
    for v in rows:
        by_design[(v.role, v.overrides.get("training_cells"))].add(v.overrides["oversample_groups"])
    assert set(by_design) == {("elastic+partial", None), ("colocate+partial", None), ("elastic3+partial", None),
                              ("elastic3 ablation", None)} | {("async+partial", c) for c in (1, 2, 3)}
    assert all(ks == {4, 8, 12, 16} for (role, _), ks in by_design.items() if role != "elastic3 ablation")
    assert by_design[("elastic3 ablation", None)] == {8}  # its mechanisms off at half a batch, as before


@pytest.mark.parametrize("sweep", [[0], [17], []])
def test_an_ablation_sweep_outside_a_batch_is_refused(sweep):
    from gyre.sim.runner import oversample_sweep

    with pytest.raises(ConfigError, match=r"each value must be 1\.\.16"):
        oversample_sweep(load_scenario("seed-2.4t"), sweep)


class _Clock:
    """Just what SharedLink reads of a Simulation: the time and an agenda, run in order."""

    def __init__(self) -> None:
        from gyre.sim.clock import Agenda

        self.now, self.agenda = 0, Agenda()

    def run(self) -> None:
        while (due := self.agenda.next_due()) is not None:
            self.now = due
            while (action := self.agenda.pop_due(due)) is not None:
                action()


@pytest.mark.parametrize("first, expected", [
    (None, {"publish": 90, "join": 60}), ("publish", {"publish": 60, "join": 90}),
    ("join", {"publish": 90, "join": 30})])
def test_the_core_link_shares_evenly_or_lets_one_kind_go_first(first, expected):
    """A 60 s publish and a 30 s pull starting together: shared evenly the pull ends at 60 s and the publish
    at 90 s (60 s more for the publish: processor sharing); either going first ends at its time alone and the
    other pays the wait, resuming where it stopped — the link is never idle while work is left."""
    from gyre.sim.training import SharedLink

    clock = _Clock()
    link = SharedLink(clock, first)  # type: ignore[arg-type]
    took: dict[str, float] = {}
    link.start(60, lambda s: took.__setitem__("publish", s), "publish")
    link.start(30, lambda s: took.__setitem__("join", s), "join")
    clock.run()
    assert took == pytest.approx(expected, abs=1e-5)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), oversample=st.integers(3, 4), staleness=st.integers(0, 2),
       policy=st.sampled_from(["async", "elastic"]))
def test_past_half_a_batch_no_group_is_ever_older_than_the_bound(seed, oversample, staleness, policy):
    sc = with_values(tailed(4), {"seed": seed})
    overrides = {"stream_micro_steps": True, "partial_rollouts": True, "oversample_groups": oversample,
                 "staleness": staleness}
    result, events = _run(sc, policy, overrides)
    assert result.max_group_lag <= staleness + 1
    assert sum(e.kind == "train_step_finished" for e in events) == 3


def _rejoin_run(rejoin: bool, policy: str = "elastic", version: str | None = "elastic/3", overrides=None):
    sc = with_values(load_scenario("tiny"), {"training.rejoin_keeps_weights": rejoin, "steps": 5})
    pol = get_policy(policy, version)
    values = scenario_values(sc, pol, overrides if overrides is not None else
                             {"partial_rollouts": True, "oversample_groups": 2})
    sink = MemorySink()
    result = simulate(sc, policy, sink=sink, version=version, params=pol.run_params(values),
                      workload=sample_workload(sc, sc.seed, 5))
    return result, sink.events


@pytest.mark.parametrize("policy, version, overrides", [
    ("elastic", "elastic/3", None), ("colocate", None, {"stream_micro_steps": True})])
def test_a_satellite_back_in_the_version_it_trained_reloads_its_weights_instead_of_pulling_them(
        policy, version, overrides):
    """``rejoin_keeps_weights`` (#27): a satellite that comes back to training while the trainer's weights are
    still those it last trained on or was handed at a step end (offloaded to host memory when it left) costs
    no pull — elastic/3's satellite recalled mid-step and lent again, colocate's satellites each step, which
    were handed the update at the step end. Every other join pulls, as before. Which joins are free is read
    back from the log alone."""
    _, plain = _rejoin_run(False, policy, version, overrides)
    assert all(e.transfer_s > 0 for e in plain if e.kind == "satellite_joined")
    _, events = _rejoin_run(True, policy, version, overrides)
    held, joined, free, pulled = {}, set(), 0, 0
    for e in events:
        if e.kind == "satellite_joined":
            if held.get(e.cell_id) == e.policy_version:
                assert e.transfer_s == 0
                free += 1
            else:
                assert e.transfer_s > 0
                pulled += 1
            held[e.cell_id] = e.policy_version
            joined.add(e.cell_id)
        elif e.kind == "satellite_left":
            joined.discard(e.cell_id)
        elif e.kind == "train_step_finished":
            held |= dict.fromkeys(joined, e.policy_version)
    assert free and pulled


def test_a_fixed_training_pool_never_rejoins_and_runs_the_same_with_rejoins_free():
    overrides = {"training_cells": 2, "stream_micro_steps": True}
    (off, _), (on, _) = (_rejoin_run(flag, "async", None, overrides) for flag in (False, True))
    assert on.hours == off.hours
