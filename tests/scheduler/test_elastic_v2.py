"""elastic/2 weighs each switch against what it buys, from the view's own measurements."""

import pytest

from gyre.errors import ConfigError
from gyre.events.models import ExecutionFinished, MicroStepFinished, RoleSwitchCompleted
from gyre.scheduler import ELASTIC, ELASTIC_V1, ElasticParams, get_policy

CHEAP = ElasticParams()  # 8.52 s + 3.46 s
SLOW = ElasticParams(switch_to_training_s=1800, switch_to_rollout_s=1800)
ALL = ["cell-0", "cell-1", "cell-2", "cell-3"]


def training_core_with_measured_micro_steps(cluster, seconds: float = 10.0):
    """The core trains step 0 (8 micro-steps planned, none claimed); micro-steps take ``seconds``."""
    cluster.run(4, ["cell-1", "cell-2"])
    cluster.switch("cell-0", "training")
    cluster.open_step(0)
    for m in range(3):
        cluster.fold.apply(MicroStepFinished(step=0, cell_id="cell-0", micro_step=m, duration_s=seconds))
    return cluster


def test_a_loan_that_pays_for_its_round_trip_happens(cluster):
    training_core_with_measured_micro_steps(cluster)  # gain 8 x 10 s / 2 cells = 40 s > 12 s
    decisions = ELASTIC.decide(cluster.view, CHEAP)
    # the empty cell-3 first, then cell-1 (its 2 calls fit cell-2 with the hysteresis): 26.7 s > 12 s
    assert [d.cell_id for d in decisions] == ["cell-3", "cell-1"]


def test_a_loan_shorter_than_its_round_trip_does_not(cluster):
    training_core_with_measured_micro_steps(cluster)
    assert ELASTIC.decide(cluster.view, SLOW) == []
    assert ELASTIC_V1.decide(cluster.view, SLOW) != []  # elastic/1 ignores the cost


def test_measured_switch_times_replace_the_priors(cluster):
    training_core_with_measured_micro_steps(cluster)
    cluster.fold.apply(RoleSwitchCompleted(cell_id="cell-0", from_role="rollout", to_role="training",
                                           duration_s=1000.0))
    assert ELASTIC.decide(cluster.view, CHEAP) == []  # 1000 s measured beats the 8.52 s prior


def test_before_any_measurement_the_core_leads_whatever_the_cost(cluster):
    cluster.run(6, ALL)
    assert next(d.cell_id for d in ELASTIC.decide(cluster.view, SLOW)) == "cell-0"


def recall_setup(cluster, execution_s: float):
    """Core and cell-3 train; 8 queued executions find no slot in cells 1-2 (16 slots, 24 wanted)."""
    done = cluster.run(2, ["cell-1"])
    for execution in done:
        cluster.fold.apply(ExecutionFinished(execution_id=execution, status="completed", duration_s=execution_s))
    cluster.switch("cell-0", "training")
    cluster.switch("cell-3", "training")
    cluster.run(16, ["cell-1", "cell-2"])
    cluster.queue(8)
    return cluster


def test_a_recall_that_pays_for_itself_happens(cluster):
    recall_setup(cluster, execution_s=600)  # queue of 8 drains in 8 x 600 / 16 = 300 s > 12 s
    assert [d.cell_id for d in ELASTIC.decide(cluster.view, CHEAP)] == ["cell-3"]


def test_an_expensive_recall_is_skipped(cluster):
    recall_setup(cluster, execution_s=600)  # 300 s < 3600 s round trip
    assert ELASTIC.decide(cluster.view, SLOW) == []
    assert [d.cell_id for d in ELASTIC_V1.decide(cluster.view, SLOW)] == ["cell-3"]


def test_with_no_rollout_capacity_a_cell_always_returns(make_cluster):
    cluster = make_cluster(cells=2)
    cluster.switch("cell-0", "training")
    cluster.switch("cell-1", "training")
    cluster.queue(4)
    assert [d.cell_id for d in ELASTIC.decide(cluster.view, SLOW)] == ["cell-1"]


def test_without_migration_a_busy_cell_stays(cluster):
    cluster.run(2, ["cell-0"])  # the core holds work: with migration it would leave and redirect it
    assert next(d.cell_id for d in ELASTIC.decide(cluster.view, CHEAP)) == "cell-0"
    assert ELASTIC.decide(cluster.view, ElasticParams(migrate=False)) == []


def test_versions_are_looked_up_by_name():
    assert get_policy("elastic").version == "elastic/2"
    assert get_policy("elastic", "elastic/1") is ELASTIC_V1
    with pytest.raises(ConfigError, match="shipped versions: elastic/1, elastic/2"):
        get_policy("elastic", "elastic/9")
