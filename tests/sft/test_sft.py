"""The warm start's parts: task families and their splits, the expert's demonstrations as the grader sees
them, assistant-only masks in both message formats, and a resumed SFT run that equals an uninterrupted one."""

import json
import random
import sys
from pathlib import Path

import pytest

from gyre.harness.tasks import TaskSet
from gyre.model import build_tokenizer
from gyre.sft.data import render
from gyre.sft.expert import Expert, answer_call, family_tasks, mistake, to_anthropic
from gyre.sft.families import (
    COPYING_FAMILIES,
    FAMILIES,
    HELDOUT_PAIRS,
    INPUT_FILES,
    RESERVED_NAMES,
    drill_tasks,
    fresh_training_tasks,
    generate,
    parameters,
    task_set_toml,
)

TOY = Path(__file__).resolve().parents[2] / "tasks" / "toy"
sys.path.insert(0, str(TOY))
from grading import grade  # noqa: E402  (the toy grader, as its command evaluator runs it)


def test_checked_in_task_sets_are_the_generated_ones():
    train, heldout = generate()
    assert (TOY / "learn-train.toml").read_text() == task_set_toml("train", train)
    assert (TOY / "learn-heldout.toml").read_text() == task_set_toml("heldout", heldout)
    assert len(TaskSet.load(TOY / "learn-train.toml")) == len(train)


def test_heldout_split_has_unseen_parameters_and_combinations():
    train, heldout = generate()
    seen = set().union(*(parameters(t) for t in train))
    assert {t.family for t in heldout} == set(FAMILIES)
    assert all(not parameters(t) & seen for t in heldout if t.family != "pyfunc")
    trained_pairs = {(t.family, t.inputs[0]) for t in train}
    assert HELDOUT_PAIRS.isdisjoint(trained_pairs)
    fresh = fresh_training_tasks(300, seed=1)
    assert not set().union(*(parameters(t) for t in fresh if t.family != "pyfunc")) & \
        set().union(*(parameters(t) for t in heldout if t.family != "pyfunc"))
    assert HELDOUT_PAIRS.isdisjoint({(t.family, t.inputs[0]) for t in fresh})
    assert {(t.family, t.inputs[0]) for t in heldout} >= HELDOUT_PAIRS


@pytest.mark.parametrize("family", FAMILIES)
def test_solutions_pass_the_grader_and_mistakes_fail_it(family, tmp_path):
    task = next(t for t in family_tasks(TOY / "learn-train.toml") if t.family == family)
    for content, passes in ((task.solution, True), (mistake(task, random.Random(0)), False)):
        (tmp_path / task.answer_file).write_text(content)
        reward, _ = grade(task.grading, tmp_path, task.answer_file)
        assert (reward == 1.0) is passes, (content, reward)


def test_a_sum_is_computed_by_a_tool_into_the_answer_file_and_its_slip_is_the_operator(tmp_path):
    task = next(t for t in family_tasks(TOY / "learn-train.toml") if t.family == "add")
    expert = Expert(error_rate=0.0, skip_check_rate=0.0)
    workspace = expert.tools_module.WorkspaceTools(tmp_path)
    for answer, passes in ((task.solution, True), (mistake(task, random.Random(0)), False)):
        for name, content in task.files.items():
            (tmp_path / name).write_text(content)
        name, arguments = answer_call(task, answer)
        assert name == "run" and workspace.call(name, arguments) == "exit code 0\n"
        assert (tmp_path / task.answer_file).read_text() == f"{answer}\n"  # the tool computed it
        reward, _ = grade(task.grading, tmp_path, task.answer_file)
        assert (reward == 1.0) is passes, (answer, reward)
    with pytest.raises(ValueError, match="neither"):
        answer_call(task, str(int(task.solution) + 1))  # no command computes an off-by-one
    record = expert.demonstrate(task)
    assert [c["function"]["name"] for m in record["messages"] for c in m.get("tool_calls", [])] == \
        ["read_file", "run", "run"]
    assert record["messages"][-2]["content"] == f"exit code 0\n{task.solution}\n"  # the check reads it back


@pytest.mark.parametrize("family", ["reverse", "concat"])
def test_with_commands_the_expert_reverses_and_joins_with_a_tool_and_slips_in_the_command(family, tmp_path):
    """``commands``: rev / paste compute the answer into the file (the grader passes it), the slip is the same
    command's plausible mistake (cat, the files swapped), and neither the expert nor answer_call invents another."""
    commands = ("add", "reverse", "concat")
    task = next(t for t in family_tasks(TOY / "learn-train.toml") if t.family == family)
    expert = Expert(error_rate=0.0, skip_check_rate=0.0, commands=commands)
    workspace = expert.tools_module.WorkspaceTools(tmp_path)
    slip = mistake(task, random.Random(0), commands)
    for answer, passes in ((task.solution, True), (slip, False)):
        for name, content in task.files.items():
            (tmp_path / name).write_text(content)
        name, arguments = answer_call(task, answer, commands)
        assert name == "run" and workspace.call(name, arguments) == "exit code 0\n", arguments
        assert (tmp_path / task.answer_file).read_text() == f"{answer}\n"  # the tool computed it
        reward, _ = grade(task.grading, tmp_path, task.answer_file)
        assert (reward == 1.0) is passes, (answer, reward)
    with pytest.raises(ValueError, match="neither"):
        answer_call(task, task.solution[:-1], commands)
    assert answer_call(task, task.solution)[0] == "write_file"  # without commands: written letter by letter
    drill = expert.drill(drill_tasks(8, seed=1, families=(family,))[0])
    assert [c["function"]["name"] for m in drill["messages"] for c in m.get("tool_calls", [])][-1] == "run"
    with pytest.raises(ValueError, match="a command for add, reverse, concat only"):
        Expert(commands=("add", "upper"))


def test_demonstration_is_multi_turn_with_real_tool_results():
    task = next(t for t in family_tasks(TOY / "learn-train.toml") if t.family == "concat")
    record = Expert(error_rate=0.0, skip_check_rate=0.0).demonstrate(task)
    assistant = [m for m in record["messages"] if m["role"] == "assistant"]
    assert [c["function"]["name"] for m in assistant[:-1] for c in m["tool_calls"]] == \
        ["read_file", "read_file", "write_file", "run"]
    results = [m["content"] for m in record["messages"] if m["role"] == "tool"]
    assert results[0] == task.files[task.inputs[0]] and results[-1] == f"exit code 0\n{task.solution}"
    assert "tool_calls" not in assistant[-1]


def test_loss_mask_covers_assistant_output_only_in_both_formats():
    tokenizer = build_tokenizer()
    task = family_tasks(TOY / "learn-train.toml")[0]
    record = Expert(error_rate=0.0, skip_check_rate=0.0).demonstrate(task)
    example = render(record, tokenizer)
    assert render(json.loads(json.dumps(to_anthropic(record))), tokenizer) == example
    trained = tokenizer.decode([t for t, m in zip(example.input_ids, example.assistant, strict=True) if m])
    assert trained.count("<|im_end|>") == 4 and trained.endswith(f"Done: {task.solution}<|im_end|>")
    assert task.prompt not in trained and "<|im_start|>" not in trained and "exit code" not in trained
    assert f'"content": "{task.solution}"' in trained


def test_every_prompt_names_its_input_file_after_in_never_first():
    """A sentence-initial file name tokenizes apart from the same name inside a sentence (the BPE merges "data"
    at a line's start): the tiny policy read one of the three files at random where the prompt began with it."""
    train, heldout = generate()
    for task in train + heldout:
        assert f" in {task.inputs[0]}" in task.prompt and not task.prompt.startswith(task.inputs[0]), task.prompt


def test_a_first_read_drill_trains_only_the_call_reading_the_named_file_in_the_harness_context():
    tokenizer = build_tokenizer()
    expert = Expert()
    for task in [t for t in fresh_training_tasks(12, seed=3) if t.family in ("pyfunc", "add", "concat")]:
        record = expert.first_read(task)
        assert [m["role"] for m in record["messages"]] == ["system", "user", "assistant"]
        assert record["messages"][0]["content"] == expert.agent.SYSTEM_PROMPT and record["tools"] == expert.tools
        example = render(record, tokenizer)
        trained = tokenizer.decode([t for t, m in zip(example.input_ids, example.assistant, strict=True) if m])
        assert trained.count("<|im_end|>") == 1 and f'"path": "{task.inputs[0]}"' in trained
        assert task.prompt not in trained and "read_file" in trained



@pytest.mark.parametrize("make", [lambda share: fresh_training_tasks(300, seed=2, other_names=share),
                                  lambda share: drill_tasks(300, seed=2, families=COPYING_FAMILIES,
                                                            other_names=share)], ids=["fresh", "drills"])
def test_other_names_move_a_share_of_tasks_to_random_files_and_leave_the_rest_as_they_were(make):
    """Renaming draws from its own generator: with share 0 the tasks are those made before the option existed,
    and with a share the tasks that keep their file are unchanged too (same words, same numbers)."""
    plain, renamed = make(0.0), make(0.5)
    assert plain == make(0.0)
    moved = [t for t in renamed if t.inputs[0] not in INPUT_FILES]
    assert 100 < len(moved) < 200
    for task in moved:
        assert task.inputs[0] not in RESERVED_NAMES and task.inputs[0].endswith(".txt")
        assert f" in {task.inputs[0]}" in task.prompt and set(task.inputs) <= set(task.files)
    assert all(a == b for a, b in zip(plain, renamed, strict=True) if b.inputs[0] in INPUT_FILES)


def test_a_sum_over_a_randomly_named_file_reads_and_computes_from_that_file(tmp_path):
    """What the held-out sum of input.txt needs: the command's path copied from the prompt, not the family's."""
    task = next(t for t in fresh_training_tasks(60, seed=2, other_names=1.0) if t.family == "add")
    record = Expert(error_rate=0.0, skip_check_rate=0.0).demonstrate(task)
    calls = [json.loads(c["function"]["arguments"]) for m in record["messages"] for c in m.get("tool_calls") or []]
    assert calls[0] == {"path": task.inputs[0]} and f" {task.inputs[0]} > answer.txt" in calls[1]["command"]
    assert record["messages"][-1]["content"] == f"Done: {task.solution}"
    assert record["messages"][-2] == {"role": "tool", "tool_call_id": "call_2",
                                      "content": f"exit code 0\n{task.solution}\n"}, \
        "the check (cat answer.txt) shows the sum the command computed from the renamed file"


def test_other_names_is_a_share():
    from pydantic import ValidationError

    from gyre.sft.run import DemonstrationsSection

    assert DemonstrationsSection(path="d.jsonl", other_names=0.5).other_names == 0.5
    with pytest.raises(ValidationError, match="other_names"):
        DemonstrationsSection(path="d.jsonl", other_names=1.5)
    with pytest.raises(ValueError, match=r"other_names -0\.1: a share"):
        fresh_training_tasks(10, seed=0, other_names=-0.1)  # what `python -m gyre.sft.expert --other-names` reaches


def test_commands_name_add_and_known_command_families():
    from pydantic import ValidationError

    from gyre.sft.run import DemonstrationsSection

    assert DemonstrationsSection(path="d.jsonl", commands=["add", "reverse"]).commands == ("add", "reverse")
    for bad in (["reverse"], ["add", "upper"]):
        with pytest.raises(ValidationError, match=r"commands \[.*\]: add and any of reverse, concat"):
            DemonstrationsSection(path="d.jsonl", commands=bad)


def test_a_family_s_own_error_rate_replaces_the_shared_one():
    """`error_rates`: concat never slips and every other family always does (error_rate 1)."""
    from pydantic import ValidationError

    from gyre.sft.run import DemonstrationsSection

    expert = Expert(error_rate=1.0, skip_check_rate=1.0, error_rates={"concat": 0.0})
    seen = set()
    for task in [t for t in fresh_training_tasks(60, seed=4) if t.family in ("concat", "copy", "upper")]:
        record = expert.demonstrate(task)
        (written,) = [json.loads(c["function"]["arguments"])["content"] for m in record["messages"]
                      for c in m.get("tool_calls", []) if c["function"]["name"] == "write_file"]
        assert (written == task.solution) is (task.family == "concat"), (task.family, written, task.solution)
        seen.add(task.family)
    assert seen == {"concat", "copy", "upper"}
    with pytest.raises(ValueError, match=r"error_rates \['concats'\]"):
        Expert(error_rates={"concats": 0.1})
    assert DemonstrationsSection(path="d.jsonl", error_rates={"concat": 0.2}).error_rates == {"concat": 0.2}
    with pytest.raises(ValidationError, match=r"error_rates \['cat'\]: name families of"):
        DemonstrationsSection(path="d.jsonl", error_rates={"cat": 0.2})
    with pytest.raises(ValidationError, match=r"error_rates\.concat"):
        DemonstrationsSection(path="d.jsonl", error_rates={"concat": 1.5})


@pytest.mark.integration
def test_resumed_sft_equals_an_uninterrupted_run(tmp_path):
    from gyre.sft.expert import write_demonstrations
    from gyre.sft.run import SftConfig, run_sft

    demos = tmp_path / "demos.jsonl"
    write_demonstrations(TOY / "learn-train.toml", demos, per_task=1, seed=0, error_rate=0.3)
    lines = demos.read_text().splitlines()[:8]
    demos.write_text("\n".join(lines) + "\n")

    def config(run_dir: Path, steps: int) -> SftConfig:
        return SftConfig.model_validate({
            "run_dir": run_dir, "steps": steps, "batch_size": 2, "checkpoint_every": 2,
            "demonstrations": {"path": demos},
            "model": {"vocab_size": 300, "hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1,
                      "intermediate_size": 64, "context": 2048}})

    run_sft(config(tmp_path / "a", 4))
    run_sft(config(tmp_path / "b", 2))
    out = run_sft(config(tmp_path / "b", 4), resume=True)
    curve = [json.loads(line) for line in (tmp_path / "a" / "loss.jsonl").read_text().splitlines()]
    resumed = [json.loads(line) for line in (tmp_path / "b" / "loss.jsonl").read_text().splitlines()]
    assert [c["loss"] for c in curve] == [c["loss"] for c in resumed] and curve[-1]["loss"] < curve[0]["loss"]
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert "<tool_call>" in json.loads((out / "tokenizer_config.json").read_text()).get("chat_template", "") or \
        (out / "chat_template.jinja").is_file()
