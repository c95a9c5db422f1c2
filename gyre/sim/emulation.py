"""A scenario's accelerator for an emulated live run (`gyre.emulate`): the same costs the simulator charges."""

from gyre.emulate import Accelerator
from gyre.sim.calls import CallTiming
from gyre.sim.scenario import Scenario


def accelerator(scenario: Scenario) -> Accelerator:
    """One cell of ``scenario``: its decode curve, prefill, training, publish, join and switch costs, and
    whether the core's joins and publishes share one link."""
    d, t, r = scenario.decode, scenario.training, scenario.rollout
    return Accelerator(
        step_ms=d.step_ms, per_request_ms=d.per_request_ms, per_mtoken_ms=d.per_mtoken_ms,
        prefill_s_per_mtoken=CallTiming(scenario).prefill_s_per_token * 1e6,
        train_s_per_mtoken=t.cell_s_per_mtoken(scenario.cluster.gpus_per_cell), optimizer_s=t.optimizer_s,
        publish_s=t.publish_s, satellite_join_s=t.satellite_join_s, to_training_s=scenario.switch.to_training_s,
        to_rollout_s=scenario.switch.to_rollout_s, kv_bytes_per_token=r.kv_bytes_per_token, kv_gb_per_s=r.kv_gb_per_s,
        share_core_link=t.share_core_link)
