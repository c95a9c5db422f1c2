"""The elastic rule on hand-built views: capacity, hysteresis, the core's privileges, redirects."""

import copy

from gyre.events.models import CellLost
from gyre.scheduler import ELASTIC, ElasticParams

P = ElasticParams()  # hysteresis 2; 4 cells x 8 slots in the fixture
ALL = ["cell-0", "cell-1", "cell-2", "cell-3"]


def decide(cluster, params=P):
    return ELASTIC.decide(cluster.view, params)


def test_core_leaves_exactly_when_the_rest_keep_the_hysteresis(cluster):
    cluster.run(22, ALL)  # remaining capacity 24 = 22 + hysteresis 2
    [decision] = decide(cluster)
    assert (decision.cell_id, decision.from_role, decision.to_role) == ("cell-0", "rollout", "training")
    assert decision.watermark == 22


def test_one_more_execution_keeps_the_core_in_rollout(cluster):
    cluster.run(23, ALL)
    assert decide(cluster) == []


def test_without_hysteresis_the_switch_is_exactly_at_capacity(cluster):
    cluster.run(24, ALL)
    assert [d.cell_id for d in decide(cluster, ElasticParams(hysteresis_slots=0))] == ["cell-0"]
    cluster.queue(1)
    assert decide(cluster, ElasticParams(hysteresis_slots=0)) == []


def test_several_cells_leave_in_one_round_core_first_then_fewest_redirects(cluster):
    cluster.run(6, ALL)  # loads 2, 2, 1, 1
    decisions = decide(cluster)
    assert [d.cell_id for d in decisions] == ["cell-0", "cell-2", "cell-3"]  # 6 + 2 <= 8 left in rollout
    assert all(d.to_role == "training" for d in decisions)
    moved = [r for d in decisions for r in d.redirects]
    assert len(moved) == 4 and all(r.to_cell_id == "cell-1" for r in moved)  # never into a cell that leaves too


def test_redirects_name_every_inflight_call_and_fit_free_slots(cluster):
    executions = cluster.run(20, ALL)
    [decision] = decide(cluster)
    on_core = set(cluster.view.cluster.inflight("cell-0"))
    assert {r.call_id for r in decision.redirects} == on_core and len(on_core) == 5
    for r in decision.redirects:
        assert r.execution_id in executions and r.to_cell_id != "cell-0"
    for cell in ALL[1:]:
        arriving = sum(r.to_cell_id == cell for r in decision.redirects)
        assert cluster.view.load(cell) + arriving <= 8


def test_satellites_only_follow_the_core(make_cluster):
    cluster = make_cluster(slots=[16, 4, 8, 8])  # the core is the big cell
    cluster.run(20, ["cell-0", "cell-2", "cell-3"])  # a 4-slot satellite could go, the core cannot
    assert decide(cluster) == []


def test_no_training_work_keeps_cells_rolling_out(cluster):
    for execution in cluster.run(4, ALL):
        cluster.finish(execution)
    cluster.open_step(0)
    cluster.close_step(0)  # the only batch is trained
    assert cluster.view.watermark == 0 and not cluster.view.training_pending
    assert decide(cluster) == []


def test_the_last_cell_leaves_once_nothing_rolls_out(cluster):
    executions = cluster.run(4, ["cell-3"])
    for cell in ALL[:3]:
        cluster.switch(cell, "training")
    assert decide(cluster) == []  # 4 running, no capacity would remain
    for execution in executions:
        cluster.finish(execution)
    [decision] = decide(cluster)  # hysteresis does not apply to an empty rollout
    assert decision.cell_id == "cell-3" and decision.redirects == []


def test_watermark_above_capacity_returns_idle_satellites_first(cluster):
    for cell in ALL:
        cluster.switch(cell, "training")
    cluster.open_step(0, claims={0: "cell-0", 1: "cell-1"})  # cell-1 is busy
    cluster.queue(10)
    decisions = decide(cluster)
    assert [(d.cell_id, d.to_role) for d in decisions] == [("cell-2", "rollout"), ("cell-3", "rollout")]


def test_core_never_leaves_training_while_it_owns_a_step(cluster):
    for cell in ALL:
        cluster.switch(cell, "training")
    cluster.open_step(0)
    cluster.queue(40)
    decisions = decide(cluster)
    assert [d.cell_id for d in decisions] == ["cell-1", "cell-2", "cell-3"]
    cluster.close_step(0)
    cluster.apply(decisions)
    assert [d.cell_id for d in decide(cluster)] == ["cell-0"]


def test_hysteresis_stops_flapping(cluster):
    """The watermark wobbling around the threshold moves the core once, not back and forth."""
    executions = cluster.run(22, ALL)
    switches = []
    for step in range(12):
        decisions = decide(cluster)
        cluster.apply(decisions)
        switches += decisions
        if step % 2:  # wobble: +1 then -1 around 22..23 (return needs more than 24)
            cluster.finish(executions.pop())
        else:
            executions += cluster.run(1, ["cell-1"])
    assert [(d.cell_id, d.to_role) for d in switches] == [("cell-0", "training")]


def test_returns_only_when_the_watermark_exceeds_capacity(cluster):
    cluster.run(22, ALL)
    cluster.apply(decide(cluster))  # core trains; rollout capacity 24
    cluster.run(2, ["cell-1"])
    assert decide(cluster) == []  # 24: still served
    cluster.queue(1)
    assert [(d.cell_id, d.to_role) for d in decide(cluster)] == [("cell-0", "rollout")]


def test_lost_cells_do_not_count(cluster):
    cluster.run(15, ["cell-1", "cell-2"])
    assert [d.cell_id for d in decide(cluster)] == ["cell-0"]  # 24 left for 15 + 2
    cluster.fold.apply(CellLost(cell_id="cell-3"))
    assert decide(cluster) == []  # 16 left for 15 + 2


def test_decide_is_pure(cluster):
    cluster.run(10, ALL)
    before = copy.deepcopy(cluster.fold.states)
    first = decide(cluster)
    assert decide(cluster) == first
    assert cluster.fold.states == before
