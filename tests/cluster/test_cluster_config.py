"""`gyre run` configuration: the shipped example loads, and bad input names what is wrong."""

from pathlib import Path

import pytest

from gyre.cluster.config import ClusterConfig, ClusterSection
from gyre.errors import ConfigError
from gyre.scheduler import get_policy

EXAMPLE = Path(__file__).parents[2] / "examples" / "cluster-cpu.toml"


def test_the_example_loads_with_its_policy_parameters() -> None:
    config = ClusterConfig.load(EXAMPLE)
    assert config.cluster.cell_ids == ["cell0", "cell1", "cell2", "cell3"] and config.cluster.core == "cell0"
    params = get_policy(config.scheduler.policy).params(config.policy_params())
    assert params.hysteresis_slots == 1


def test_the_json_a_controller_writes_reads_back(tmp_path: Path) -> None:
    config = ClusterConfig.load(EXAMPLE)
    path = tmp_path / "cluster-config.json"
    path.write_text(config.model_dump_json())
    assert ClusterConfig.load(path) == config
    # the command line's keys apply to it as to a TOML file (they were ignored: `--steps`, `--emulate`'s)
    overridden = ClusterConfig.load(path, {"steps": 7, "cluster.cells": 2})
    assert (overridden.steps, overridden.cluster.cells) == (7, 2)
    with pytest.raises(ConfigError, match=r"stepz.*given on the command line"):
        ClusterConfig.load(path, {"stepz": 7})


@pytest.mark.parametrize(("toml", "named"), [
    ('[cluster]\ncells = 2\ncore = "cell5"\n', "cluster.core 'cell5' is not one of the cells"),
    ('[cluster]\ncells = 1\n[scheduler]\npolicy = "async"\n', "async needs at least two cells"),
    ('[scheduler]\npolicy = "fifo"\n', "scheduler.policy"),
    ('[cluster]\nslotz = 3\n', "cluster.slotz"),
    ('[cluster]\nheartbeat_s = 5\ndead_after_s = 5\n', "heartbeat_s (5.0) must be below cluster.dead_after_s"),
])
def test_bad_input_is_refused_naming_the_key(tmp_path: Path, toml: str, named: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match="invalid cluster config") as refused:
        ClusterConfig.load(path)
    assert named in str(refused.value)


def test_links_beat_every_third_of_dead_after_s_unless_told() -> None:
    assert ClusterSection().heartbeat_period_s == ClusterSection().dead_after_s / 3 == 10.0
    assert ClusterSection(dead_after_s=6).heartbeat_period_s == 2.0
    assert ClusterSection(heartbeat_s=0.5, dead_after_s=6).heartbeat_period_s == 0.5


def test_unknown_policy_parameters_are_refused() -> None:
    config = ClusterConfig.model_validate({"scheduler": {"policy": "elastic", "params": {"hysteresis": 1}}})
    with pytest.raises(ValueError, match="hysteresis"):
        get_policy("elastic").params(config.policy_params())


def test_a_command_line_override_is_refused_as_a_key_in_the_file_would_be() -> None:
    with pytest.raises(ConfigError, match="invalid cluster config") as refused:
        ClusterConfig.load(EXAMPLE, {"steps": 0, "scheduler.policy": "fifo"})
    message = str(refused.value)
    assert "steps: Input should be greater than 0 (given on the command line)" in message
    assert "scheduler.policy" in message and "\n" not in message
    assert ClusterConfig.load(EXAMPLE, {"steps": 3, "scheduler.policy": "async"}).scheduler.policy == "async"


def test_a_section_the_command_does_not_use_is_refused_naming_it() -> None:
    from gyre.config import TrainConfig

    with pytest.raises(ConfigError, match="cluster: a train run has no such key or section"):
        TrainConfig.load(EXAMPLE)


def test_the_policy_version_is_chosen_by_the_config_and_a_bad_one_names_the_shipped_ones() -> None:
    assert ClusterConfig.load(EXAMPLE).scheduler.version is None  # the policy's current one: elastic/2
    chosen = ClusterConfig.load(EXAMPLE, {"scheduler.version": "elastic/3"})
    assert get_policy(chosen.scheduler.policy, chosen.scheduler.version).version == "elastic/3"
    with pytest.raises(ConfigError, match="invalid cluster config") as refused:
        ClusterConfig.load(EXAMPLE, {"scheduler.version": "elastic/9"})
    assert ("scheduler.version: Value error, unknown version 'elastic/9' of policy 'elastic'; shipped versions: "
            "elastic/1, elastic/2, elastic/3 (given on the command line)") in str(refused.value)
    with pytest.raises(ConfigError, match="unknown version 'elastic/3' of policy 'colocate'"):
        ClusterConfig.load(EXAMPLE, {"scheduler.policy": "colocate", "scheduler.version": "elastic/3"})


def test_a_train_run_refuses_a_bad_version_before_it_starts(tmp_path: Path) -> None:
    """`gyre train`'s config (one cell) cannot import the scheduler to check it: the run host does, first."""
    from gyre.config import TrainConfig
    from gyre.run.host import RunHost

    config = TrainConfig.model_validate({"run_dir": str(tmp_path / "run"), "scheduler": {"version": "elastic/9"}})
    with pytest.raises(ConfigError, match=r"scheduler.version: unknown version 'elastic/9'.*elastic/1, elastic/2"):
        RunHost(config, topology=None)  # type: ignore[arg-type]  # refused before it is used
    assert not (tmp_path / "run").exists()


def test_gyre_run_refuses_a_bad_version_before_anything_starts(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gyre.cli import app

    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(EXAMPLE), "--run-dir", str(run_dir), "--policy-version", "elastic/9"])
    assert result.exit_code == 2, result.output
    assert "shipped versions: elastic/1, elastic/2, elastic/3" in " ".join(result.output.split())
    assert not run_dir.exists()
