"""The learning run's parts outside SFT itself: a tokenizer that spells words it never saw the same way in
every context, the cosine lr schedule, the shuffled-rewards control and the pass/fail reward of the trajectory
builder."""

import json
import sys
from pathlib import Path

import pytest

from gyre.model import build_tokenizer
from gyre.sft.checkpoint import train_bpe
from gyre.sft.data import conversation
from gyre.sft.expert import Expert, family_tasks
from gyre.sft.run import SftConfig
from gyre.trajectory import TrajectoryConfig, build

TOY = Path(__file__).resolve().parents[2] / "tasks" / "toy"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trajectory"))
from trajectory_helpers import call, calls, group, outcome, rows  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    expert = Expert(error_rate=0.0, seed=0)
    renderer = build_tokenizer()
    records = [expert.demonstrate(task) for task in family_tasks(TOY / "learn-train.toml")]
    texts = [renderer.apply_chat_template(m, tools=t, tokenize=False) for m, t in map(conversation, records)]
    return train_bpe(texts, 600)


def test_unseen_words_are_spelled_alike_everywhere_and_protocol_words_stay_whole(tokenizer):
    word = "qwyxb"  # letters no demonstration has
    pieces = {context: tokenizer.tokenize(context.format(word)) for context in
              ("<tool_response>\n{}\n</tool_response>", '{{"content": "{}"}}', "exit code 0\n{}\n")}
    spelled = [tokenizer.tokenize(letter)[0] for letter in word]
    for context, tokens in pieces.items():
        at = tokens.index(spelled[0])
        assert tokens[at:at + len(word)] == spelled, context
    assert len(tokenizer.tokenize("write_file")) <= 2 and tokenizer.tokenize("content") == ["content"]
    assert tokenizer.tokenize("12") == ["1", "2"]


def test_cosine_lr_decays_from_lr_to_min_lr():
    config = SftConfig.model_validate({"steps": 100, "lr": 1e-3, "min_lr": 1e-4, "demonstrations": {"path": "x"}})
    assert config.lr_at(0) == pytest.approx(1e-3) and config.lr_at(50) == pytest.approx(5.5e-4)
    assert config.lr_at(99) == pytest.approx(1e-4, rel=0.01)
    assert SftConfig.model_validate({"lr": 1e-3, "demonstrations": {"path": "x"}}).lr_at(7) == 1e-3


def test_shuffled_rewards_permute_advantages_within_a_group():
    rewards = [1.0, 0.0, 0.0, 0.0, 0.25, 0.5, 0.75, 0.0]
    members = [(outcome(f"e{i}", reward=r), calls(call("a", delta=[1, 2], out=[7, 8], execution=f"e{i}")))
               for i, r in enumerate(rewards)]

    def advantages(shuffle: bool) -> list[float]:
        batches, _ = build([group(members)], TrajectoryConfig(shuffle_rewards=shuffle))
        by_execution = {row["execution_id"]: row["advantages"][0] for row in rows(batches)}
        return [by_execution[f"e{i}"] for i in range(len(rewards))]

    plain, shuffled = advantages(False), advantages(True)
    assert sorted(plain) == pytest.approx(sorted(shuffled)) and plain != pytest.approx(shuffled)
    assert advantages(True) == shuffled  # seeded by the group id: the same control every time


def test_reward_threshold_trains_on_pass_or_fail():
    """A near miss (0.9, graded) and a pass get opposite advantages under a pass threshold, and a group with no
    pass has nothing to learn from (its graded differences are not what a pass rate measures)."""
    def advantages(rewards: list[float], threshold: float | None) -> list[float]:
        members = [(outcome(f"e{i}", reward=r), calls(call("a", delta=[1, 2], out=[7, 8], execution=f"e{i}")))
                   for i, r in enumerate(rewards)]
        batches, _ = build([group(members)], TrajectoryConfig(reward_threshold=threshold))
        by_execution = {row["execution_id"]: row["advantages"][0] for row in rows(batches)}
        return [by_execution[f"e{i}"] for i in range(len(rewards))]

    graded = advantages([1.0, 0.9, 0.9, 0.2], None)
    assert graded[1] > 0  # graded: the near miss is rewarded, above the group's mean
    passed = advantages([1.0, 0.9, 0.9, 0.2], 1.0)
    assert passed[0] > 0 > passed[1] and passed[1] == pytest.approx(passed[3])
    assert advantages([0.9, 0.5, 0.2, 0.0], 1.0) == pytest.approx([0.0] * 4)
    with pytest.raises(Exception, match="reward_threshold"):
        TrajectoryConfig(reward_threshold=1.5)


def test_copy_drills_are_right_random_and_stay_off_the_heldout_split(tmp_path):
    from gyre.errors import ConfigError
    from gyre.sft.families import HELDOUT_PAIRS, drill_tasks, generate, parameters

    drills = drill_tasks(200, seed=3)
    assert drills == drill_tasks(200, seed=3) and drills != drill_tasks(200, seed=4)
    _, heldout = generate()
    unseen = set().union(*(parameters(t) for t in heldout if t.family != "pyfunc"))
    expert = Expert(seed=0)
    for task in drills:
        source = task.inputs[0]
        assert (task.family, source) not in HELDOUT_PAIRS and not parameters(task) & unseen
        messages = expert.drill(task)["messages"]
        assert messages[0]["role"] == "user" and all(m["role"] != "system" for m in messages)
        read = [m["content"] for m in messages if m["role"] == "tool"][: len(task.inputs)]
        assert read == [task.files[p] for p in task.inputs]  # real tool results
        written = [c for m in messages for c in m.get("tool_calls", []) if c["function"]["name"] == "write_file"]
        assert f'"content": "{task.solution}"' in written[0]["function"]["arguments"]  # never a mistake
    assert len({t.solution for t in drills}) >= 195  # random letter strings, not the families' syllable words
    config = tmp_path / "sft.toml"
    config.write_text('drill_share = 0.5\n[demonstrations]\npath = "x"\n')
    with pytest.raises(ConfigError, match="drills > 0"):
        SftConfig.load(config)


def test_pyfunc_drills_copy_the_digit_and_only_named_families_are_drilled(tmp_path):
    from gyre.errors import ConfigError
    from gyre.sft.families import DRILL_FAMILIES, drill_tasks

    assert {t.family for t in drill_tasks(200, seed=3)} == set(DRILL_FAMILIES)  # the default: letters only
    drills = drill_tasks(200, seed=3, families=("copy", "pyfunc"))
    assert {t.family for t in drills} == {"copy", "pyfunc"}
    pyfunc = [t for t in drills if t.family == "pyfunc"]
    assert len({t.solution for t in pyfunc}) == 8  # every K of 2..9: the digit is what the drill copies
    for task in pyfunc:
        k = task.files[task.inputs[0]].strip()
        assert task.solution == f"def f(x):\n    return x * {k}\n"
    with pytest.raises(ValueError, match="sum"):
        drill_tasks(10, seed=3, families=("copy", "sum"))
    config = tmp_path / "sft.toml"
    config.write_text('[demonstrations]\npath = "x"\ndrills = 10\ndrill_families = ["copy", "sum"]\n')
    with pytest.raises(ConfigError, match=r"drill_families.*pyfunc"):
        SftConfig.load(config)


def test_the_learning_run_s_configs_chain_the_warm_start_into_rl_on_the_copying_families():
    from benchmarks.warm_start_check import interleaved
    from gyre.config import TrainConfig
    from gyre.sft.families import COPYING_FAMILIES

    examples = TOY.parents[1] / "examples"
    first, second = (SftConfig.load(examples / f"learn-cpu-sft{s}.toml") for s in ("", "-slips"))
    assert second.model.base == first.run_dir / "model"  # the second phase starts where the first ended
    assert set(second.demonstrations.drill_families) == set(COPYING_FAMILIES)
    rl = TrainConfig.load(examples / "learn-cpu.toml")
    assert rl.engine.model == str(second.run_dir / "model")
    assert list(rl.rollout.task_ids) == interleaved(list(COPYING_FAMILIES), TOY / "learn-train.toml")


def test_interleaved_training_order_mixes_the_families_in_every_step():
    from benchmarks.warm_start_check import interleaved

    ids = interleaved(["copy", "upper", "reverse", "concat"], TOY / "learn-train.toml")
    assert len(ids) == len(set(ids)) == 12 + 12 + 12 + 18
    for start in range(0, 48, 4):  # 4 groups a step: one task of each family until the shorter ones run out
        assert sorted(i.split("-")[1] for i in ids[start:start + 4]) == ["concat", "copy", "reverse", "upper"]
    with pytest.raises(SystemExit, match="nosuch"):
        interleaved(["copy", "nosuch"], TOY / "learn-train.toml")


def test_agent_stats_counts_calls_and_executions_with_a_malformed_tool_call(tmp_path):
    from benchmarks.warm_start_check import agent_stats

    results = {"heldout-s0-heldout-copy-data-0-e0": (4, 3, 0), "heldout-s0-heldout-copy-data-0-e1": (6, 5, 2),
               "learn-cpu-1.s3-g0-e0": (3, 2, 0), "learn-cpu-1.s3-g0-e1": (2, 1, 1)}
    for name, (model, tools, malformed) in results.items():
        (tmp_path / name).mkdir()
        line = {"type": "result", "model_calls": model, "tool_calls": tools, "malformed_tool_calls": malformed}
        (tmp_path / name / "harness.stdout").write_text('{"type": "progress"}\n' + json.dumps(line) + "\n")
    stats = agent_stats(tmp_path)
    assert stats["heldout-s0"] == {"executions": 2, "model_calls": 5.0, "tool_calls": 4.0, "multi_turn_share": 1.0,
                                   "malformed_share": 0.5}
    assert stats["s3"] == {"executions": 2, "model_calls": 2.5, "tool_calls": 1.5, "multi_turn_share": 0.5,
                           "malformed_share": 0.5}
