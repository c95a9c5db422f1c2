"""Scenario files: every shipped one loads; bad ones fail with errors that name the problem."""

import pytest

from gyre.errors import ConfigError
from gyre.scheduler import get_policy
from gyre.sim.runner import policy_params
from gyre.sim.scenario import SCENARIO_DIR, load_scenario, scenario_names, with_policy_values, with_values
from gyre.sim.workload import sample_workload


def test_shipped_scenarios_load():
    names = scenario_names()
    assert {"seed-2.4t", "seed-122b", "terminal-bench-like"} <= set(names)
    for name in names:
        assert load_scenario(name).name == name


def test_the_paper_scale_scenario_matches_the_brief():
    sc = load_scenario("seed-2.4t")
    assert (sc.cluster.cells, sc.cluster.nodes_per_cell, sc.steps) == (4, 48, 48)
    assert sc.batch.group_size == 16
    assert (sc.switch.to_training_s, sc.switch.to_rollout_s) == (8.52, 3.46)
    assert 24 <= load_scenario("seed-122b").cluster.cells * load_scenario("seed-122b").cluster.nodes_per_cell <= 32


def test_unknown_scenario_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown scenario 'seed-9t'; known scenarios: .*seed-2\.4t"):
        load_scenario("seed-9t")


def test_malformed_toml_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("name = 'broken'\nsteps = [\n")
    with pytest.raises(ConfigError, match=r"broken\.toml is not valid TOML"):
        load_scenario(path)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_scenario(tmp_path / "absent.toml")


def _variant(tmp_path, old: str, new: str):
    """The tiny scenario with one line changed."""
    text = (SCENARIO_DIR / "tiny.toml").read_text()
    assert old in text
    path = tmp_path / "variant.toml"
    path.write_text(text.replace(old, new))
    return path


def test_bad_fields_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"variant\.toml is invalid: cluster\.slots_per_cell"):
        load_scenario(_variant(tmp_path, "slots_per_cell = 8", "slots_per_cell = 0"))
    with pytest.raises(ConfigError, match=r"rollout\.warp_speed: Extra inputs"):
        load_scenario(_variant(tmp_path, "[rollout]\n", "[rollout]\nwarp_speed = 1\n"))
    with pytest.raises(ConfigError, match=r"steps: Field required"):
        load_scenario(_variant(tmp_path, "steps = 3\n", ""))


def test_async_must_leave_a_rollout_cell(tmp_path):
    with pytest.raises(ConfigError, match=r"training_cells \(3\) must leave at least one of the 3 cells"):
        load_scenario(_variant(tmp_path, "training_cells = 1", "training_cells = 3"))


def test_workloads_are_heavy_tailed_with_a_mass_at_the_timeout():
    sc = load_scenario("seed-2.4t")
    durations = sorted(e.duration_s for e in sample_workload(sc, 0, steps=4).executions())
    timeout_share = sum(d >= sc.rollout.timeout_s for d in durations) / len(durations)
    median = durations[len(durations) // 2]
    assert 0.1 < timeout_share < 0.4 and median < sc.rollout.timeout_s / 2


def test_any_file_is_a_scenario_and_sets_any_policy_parameter(tmp_path):
    path = _variant(tmp_path, "[policy.async]\n", "[policy.colocate]\nstream_micro_steps = true\n\n[policy.async]\n"
                    "stream_micro_steps = true\nstaleness = 1\n")
    plain = tmp_path / "my-cluster.conf"
    plain.write_text(path.read_text())
    sc = load_scenario(plain)
    assert policy_params(sc, get_policy("colocate")).stream_micro_steps is True
    async_params = policy_params(sc, get_policy("async"))
    assert async_params.stream_micro_steps is True and async_params.staleness == 1
    assert policy_params(sc, get_policy("elastic")).staleness == 0  # the shared value


def test_a_bad_policy_parameter_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"\[policy\.colocate\]: .*staleness"):
        load_scenario(_variant(tmp_path, "[policy.async]\n", "[policy.colocate]\nstaleness = 1\n\n[policy.async]\n"))
    with pytest.raises(ConfigError, match=r"decode\.share > 0 needs a decode step cost"):
        load_scenario(_variant(tmp_path, "[reward]\n", "[decode]\nshare = 0.5\n\n[reward]\n"))


def test_policy_values_are_set_by_dotted_name():
    sc = with_policy_values(load_scenario("tiny"), {"colocate.stream_micro_steps": True, "staleness": 1})
    assert sc.policy.colocate == {"stream_micro_steps": True} and sc.policy.staleness == 1
    with pytest.raises(ConfigError, match="unknown policy 'greedy'"):
        with_policy_values(sc, {"greedy.x": 1})
    with pytest.raises(ConfigError, match=r"no parameter 'switch\.warp'"):
        with_values(sc, {"switch.warp": 1})
