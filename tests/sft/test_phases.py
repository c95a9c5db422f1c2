"""A curriculum in `gyre sft` (`[[phases]]`): validated with clear errors, run in order, a phase ended early on
the written letters' loss, and a run killed mid-phase resumes to the same curve as one never interrupted."""

import json
from pathlib import Path

import pytest

from gyre.errors import ConfigError
from gyre.sft.run import SftConfig

TOY = Path(__file__).resolve().parents[2] / "tasks" / "toy"
PHASES = """
[demonstrations]
path = "x"
drills = 10

[[phases]]
name = "copy"
steps = 30
lr = 1e-3
drill_share = 1.0
until_written_loss = 0.5

[[phases]]
name = "mixture"
steps = 100
lr = 1e-3
min_lr = 1e-4
drill_share = 0.3
"""


def load(tmp_path: Path, text: str) -> SftConfig:
    path = tmp_path / "sft.toml"
    path.write_text(text)
    return SftConfig.load(path)


def test_phases_make_the_plan_and_each_its_own_cosine(tmp_path):
    config = load(tmp_path, PHASES)
    assert [p.name for p in config.plan()] == ["copy", "mixture"]
    assert config.plan()[0].checks == 50 and config.plan()[1].checks is None
    assert config.lr_at(0) == config.lr_at(29) == 1e-3
    assert config.lr_at(30) == pytest.approx(1e-3) and config.lr_at(80) == pytest.approx(5.5e-4)
    with pytest.raises(ValueError, match="past the run's last phase"):
        config.lr_at(130)
    plain = load(tmp_path, 'steps = 7\nlr = 2e-3\n[demonstrations]\npath = "x"\n')
    assert [(p.name, p.steps, p.lr, p.drill_share) for p in plain.plan()] == [("sft", 7, 2e-3, 0.0)]
    reads = load(tmp_path, 'steps = 7\nlr = 2e-3\ndrill_share = 0.2\nread_share = 0.1\n'
                           '[demonstrations]\npath = "x"\ndrills = 5\nreads = 5\n')
    assert [(p.drill_share, p.read_share) for p in reads.plan()] == [(0.2, 0.1)]
    with pytest.raises(ConfigError, match=r"drill_share 0.95 \+ read_share 0.1 is over 1"):
        load(tmp_path, 'drill_share = 0.95\nread_share = 0.1\n[demonstrations]\npath = "x"\ndrills = 5\nreads = 5\n')


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: "steps = 800\n" + t, "steps set at the top level and \\[\\[phases\\]\\] given"),
    (lambda t: "lr = 1e-3\nmin_lr = 1e-4\n" + t, "lr, min_lr set at the top level"),
    (lambda t: t.replace('"mixture"', '"copy"'), "phase names must be unique"),
    (lambda t: t.replace("drills = 10", "drills = 0"), "drill_share = 1.0 \\(phase 'copy'\\) needs"),
    (lambda t: t.replace("drill_share = 1.0", "drill_share = 1.5"), "less than or equal to 1"),
    (lambda t: t.replace("steps = 30", "steps = 0"), "phases.0.steps"),
    (lambda t: t.replace("until_written_loss", "until_loss"), "phases.0.until_loss"),
    (lambda t: t.replace('name = "copy"\n', ""), "phases.0.name"),
    (lambda t: t.replace("drill_share = 0.3", "drill_share = 0.3\nread_share = 0.2"),
     "read_share = 0.2 \\(phase 'mixture'\\) needs \\[demonstrations\\] reads > 0"),
    (lambda t: t.replace("drills = 10", "drills = 10\nreads = 5").replace("drill_share = 0.3", "drill_share = 0.9\n"
                                                                      "read_share = 0.2"),
     "phase 'mixture': drill_share 0.9 \\+ read_share 0.2 is over 1"),
])
def test_bad_phases_are_refused_with_a_clear_error(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, change(PHASES))


class Killed(Exception):
    pass


@pytest.mark.integration
def test_phases_run_in_order_end_early_and_resume_mid_phase(tmp_path):
    from gyre.sft.expert import write_demonstrations
    from gyre.sft.run import COPY_CHECKS, EARLY_ENDS, run_sft

    demos = tmp_path / "demos.jsonl"
    write_demonstrations(TOY / "learn-train.toml", demos, per_task=1, seed=0, error_rate=0.3)
    demos.write_text("\n".join(demos.read_text().splitlines()[:8]) + "\n")

    def config(run_dir: Path) -> SftConfig:
        return SftConfig.model_validate({
            "run_dir": run_dir, "batch_size": 2, "drill_batch_size": 3, "checkpoint_every": 3,
            "demonstrations": {"path": demos, "drills": 12},
            "phases": [
                # ends at its first check (any loss is under 100): step 2, not its cap of 5
                {"name": "copy", "steps": 5, "lr": 1e-3, "drill_share": 1.0, "until_written_loss": 100.0,
                 "check_every": 2},
                {"name": "mixture", "steps": 4, "lr": 5e-4, "min_lr": 1e-4, "drill_share": 0.5, "check_every": 1}],
            "model": {"vocab_size": 300, "hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1,
                      "intermediate_size": 64, "context": 2048}})

    def curve(run_dir: Path) -> list[dict]:
        return [json.loads(line) for line in (run_dir / "loss.jsonl").read_text().splitlines()]

    seen: list[dict] = []
    run_sft(config(tmp_path / "a"), progress=seen.append)
    whole = curve(tmp_path / "a")
    assert [(c["step"], c["phase"]) for c in whole] == \
        [(0, "copy"), (1, "copy"), (2, "mixture"), (3, "mixture"), (4, "mixture"), (5, "mixture")]
    assert all(c["batch"] == "drills" for c in whole[:2]) and whole[2]["lr"] == pytest.approx(5e-4)
    assert whole[-1]["lr"] < whole[3]["lr"] < whole[2]["lr"]
    assert [line["phase"] for line in seen if line.get("phase_starts")] == ["copy", "mixture"]
    assert [json.loads(line) for line in (tmp_path / "a" / EARLY_ENDS).read_text().splitlines()] == \
        [{"phase": "copy", "end": 2}]
    checks = [json.loads(line) for line in (tmp_path / "a" / COPY_CHECKS).read_text().splitlines()]
    assert [(c["step"], c["phase"]) for c in checks] == [(2, "copy")] + [(s, "mixture") for s in range(3, 7)]
    assert all(0 < c["written_letters"] < 10 for c in checks)
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == \
        ["step-000002", "step-000003", "step-000006"]  # a phase's end is checkpointed

    def kill_at_step_4(line: dict) -> None:
        if line.get("step") == 4 and "loss" in line:
            raise Killed  # after step 4 is logged, before its checkpoint (the last one is step-000003)

    with pytest.raises(Killed):
        run_sft(config(tmp_path / "b"), progress=kill_at_step_4)
    run_sft(config(tmp_path / "b"), resume=True)  # resumes in the mixture phase, at its second step
    assert curve(tmp_path / "b") == [{**c, "seconds": r["seconds"]} for c, r in zip(whole, curve(tmp_path / "b"),
                                                                                     strict=True)]
    for name in (EARLY_ENDS, COPY_CHECKS):  # the check of step-000003's weights kept once, the later ones redone
        assert (tmp_path / "b" / name).read_text() == (tmp_path / "a" / name).read_text()
    assert (tmp_path / "b" / "model" / "config.json").is_file()


@pytest.mark.integration
def test_a_phase_of_first_read_drills_trains_on_them_and_mixes_them_at_its_share(tmp_path):
    from gyre.sft.expert import write_demonstrations
    from gyre.sft.run import run_sft

    demos = tmp_path / "demos.jsonl"
    write_demonstrations(TOY / "learn-train.toml", demos, per_task=1, seed=0, error_rate=0.3)
    demos.write_text("\n".join(demos.read_text().splitlines()[:8]) + "\n")
    config = SftConfig.model_validate({
        "run_dir": tmp_path / "run", "batch_size": 2, "checkpoint_every": 100,
        "demonstrations": {"path": demos, "reads": 6},
        "phases": [{"name": "reads", "steps": 2, "lr": 1e-3, "read_share": 1.0},
                   {"name": "mixed", "steps": 12, "lr": 1e-3, "read_share": 0.5}],
        "model": {"vocab_size": 300, "hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1,
                  "intermediate_size": 64, "context": 2048}})
    run_sft(config)
    curve = [json.loads(line) for line in (tmp_path / "run" / "loss.jsonl").read_text().splitlines()]
    assert [c["batch"] for c in curve[:2]] == ["reads", "reads"]
    mixed = {c["batch"] for c in curve[2:]}
    assert mixed == {"reads", "demonstrations"}, mixed
    reads = [c for c in curve if c["batch"] == "reads"]
    demos_steps = [c for c in curve if c["batch"] == "demonstrations"]
    # a read drill trains one short call; a demonstration every turn of a solved task
    assert max(c["trained_tokens"] for c in reads) < min(c["trained_tokens"] for c in demos_steps) / 2
