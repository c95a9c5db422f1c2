"""A scripted, imperfect expert: demonstrations of the toy agent's own protocol on the training tasks.

It plays what `agents/toy_agent` does with a model — the same system prompt, the same tool schemas, real tool
results from the same workspace tools in a scratch directory — and writes one conversation per line (JSONL,
OpenAI message format by default, Anthropic with ``--format anthropic``): read each input file, write the
answer file (a sum: with `SUM_COMMAND`), check it with ``cat``, then a short final answer without a tool call.

Imperfect on purpose: with probability ``error_rate`` a demonstration writes a plausible wrong answer (a
family-specific slip: a dropped last letter, a difference for a sum, a half-reversed word, ``x + K`` for
``x * K``), and sometimes skips the check. A policy cloned from it solves a task sometimes, not always, which is
where RL helps.

    python -m gyre.sft.expert tasks/toy/learn-train.toml runs/learn/demos.jsonl --per-task 8 --fresh 2000 --seed 0
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from gyre.harness.tasks import TaskSet
from gyre.sft.families import COMMAND_FAMILIES, FAMILIES, FamilyTask, fresh_training_tasks

AGENT_DIR = Path(__file__).resolve().parents[2] / "agents" / "toy_agent"
TOOLS = ("write_file", "read_file", "run")
"""The tools the toy agent offers with ``--no-subagent`` (agents/toy_agent/harness-learn.toml)."""
SUM_COMMAND = "awk '{{print $1 {op} $2}}' {path} > {answer}"
"""How the expert adds (family add): a tool computes the sum into the answer file, as a coding agent would; a
1M-parameter model cannot add two-digit numbers, and an agent should not need to. Its slip is the wrong operator."""
REVERSE_COMMAND = "{tool} {path} > {answer}"
"""How the expert reverses with ``commands`` naming reverse: ``rev`` writes the word backwards; its slip is ``cat``
(the word unreversed). Spelling a word backwards letter by letter is the content skill the tiny policy never learned
(#29: held-out reverse <= 33% after RL)."""
CONCAT_COMMAND = "paste -d ' ' {first} {second} > {answer}"
"""How the expert joins two words with ``commands`` naming concat; its slip is the files in the other order."""
FINAL_ANSWER = "Done: {answer}"
"""The final reply repeats what was written: more copying to learn from (the answer file is what is graded)."""


def load_agent_module(name: str) -> ModuleType:
    """A module of the toy agent by path: the agent never becomes a Gyre import, and its protocol has one home."""
    if str(AGENT_DIR) not in sys.path:
        sys.path.insert(0, str(AGENT_DIR))  # agent.py imports its siblings by bare name
    spec = importlib.util.spec_from_file_location(f"toy_agent_{name}", AGENT_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def mistake(task: FamilyTask, rng: random.Random, commands: tuple[str, ...] = ("add",)) -> str:
    """A plausible wrong answer for ``task`` (with ``commands``: what the slip of the family's command writes)."""
    s = task.solution
    if task.family == "copy":
        return s[:-1]
    if task.family == "upper":
        return s[0].lower() + s[1:]
    if task.family == "reverse":
        return s[::-1] if "reverse" in commands else s[: len(s) // 2] + s[len(s) // 2:][::-1]
    if task.family == "add":  # the difference: `SUM_COMMAND` with the wrong operator
        a, b = _operands(task)
        return str(a - b)
    if task.family == "pyfunc":
        return s.replace(" * ", " + ")
    if task.family == "concat":
        first, second = s.split(" ")
        return f"{second} {first}"
    raise ValueError(task.family)


def _operands(task: FamilyTask) -> tuple[int, int]:
    """The two numbers of a sum task, as its input file holds them."""
    a, b = map(int, task.files[task.inputs[0]].split())
    return a, b


def answer_call(task: FamilyTask, answer: str, commands: tuple[str, ...] = ("add",)) -> tuple[str, dict[str, Any]]:
    """The call that writes ``answer`` into the answer file: ``write_file``, or for a family of ``commands`` the
    command that computes it there (``answer`` = what that command gives: the right answer or the family's slip)."""
    if task.family not in commands:
        return "write_file", {"path": task.answer_file, "content": answer}
    if task.family == "add":
        a, b = _operands(task)
        ops = {a + b: "+", a - b: "-"}  # b >= 1: never the same result
        if not answer.lstrip("-").isdigit() or int(answer) not in ops:
            raise ValueError(f"{task.id}: {answer!r} is neither {a} + {b} nor {a} - {b}")
        command = SUM_COMMAND.format(op=ops[int(answer)], path=task.inputs[0], answer=task.answer_file)
    elif task.family == "reverse":
        tools = {task.solution: "rev", task.solution[::-1]: "cat"}  # a syllable word is never its own reverse
        if answer not in tools:
            raise ValueError(f"{task.id}: {answer!r} is neither the word reversed nor the word")
        command = REVERSE_COMMAND.format(tool=tools[answer], path=task.inputs[0], answer=task.answer_file)
    elif task.family == "concat":
        first, second = task.inputs
        orders = {task.solution: (first, second), " ".join(task.solution.split(" ")[::-1]): (second, first)}
        if answer not in orders:
            raise ValueError(f"{task.id}: {answer!r} is neither the two words in order nor swapped")
        a, b = orders[answer]
        command = CONCAT_COMMAND.format(first=a, second=b, answer=task.answer_file)
    else:
        raise ValueError(f"{task.family!r} has no command; command families: {', '.join(COMMAND_FAMILIES)}")
    return "run", {"command": command}


def solving_calls(task: FamilyTask, answer: str,
                  commands: tuple[str, ...] = ("add",)) -> list[tuple[str, dict[str, Any]]]:
    """The tool calls that solve ``task`` writing ``answer``: read every input, then `answer_call`."""
    return [*(("read_file", {"path": p}) for p in task.inputs), answer_call(task, answer, commands)]


class Expert:
    def __init__(self, error_rate: float = 0.3, skip_check_rate: float = 0.2, seed: int = 0,
                 commands: tuple[str, ...] = ("add",), error_rates: Mapping[str, float] | None = None) -> None:
        """``error_rates``: a family's own share of wrong answers, in place of ``error_rate`` for that family."""
        if unknown := set(commands) - set(COMMAND_FAMILIES):
            raise ValueError(f"commands {sorted(unknown)}: the expert has a command for "
                             f"{', '.join(COMMAND_FAMILIES)} only")
        if unknown := set(error_rates or {}) - set(FAMILIES):
            raise ValueError(f"error_rates {sorted(unknown)}: the families are {', '.join(FAMILIES)}")
        self.error_rate, self.skip_check_rate, self.commands = error_rate, skip_check_rate, tuple(commands)
        self.error_rates = dict(error_rates or {})
        self.rng = random.Random(seed)
        self.agent = load_agent_module("agent")
        self.tools_module = load_agent_module("agent_tools")
        self.tools = [self.tools_module.SCHEMAS[n] for n in TOOLS]

    def demonstrate(self, task: FamilyTask) -> dict[str, Any]:
        """One conversation solving ``task`` (OpenAI format), its tool results real."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.agent.SYSTEM_PROMPT},
                                          {"role": "user", "content": task.prompt}]
        wrong = self.rng.random() < self.error_rates.get(task.family, self.error_rate)
        answer = mistake(task, self.rng, self.commands) if wrong else task.solution
        calls = solving_calls(task, answer, self.commands)
        if self.rng.random() >= self.skip_check_rate:
            calls.append(("run", {"command": f"cat {task.answer_file}"}))
        messages += self._play(task, calls)
        messages.append({"role": "assistant", "content": FINAL_ANSWER.format(answer=answer)})
        return {"messages": messages, "tools": self.tools, "task_id": task.id, "correct": not wrong}

    def drill(self, task: FamilyTask) -> dict[str, Any]:
        """A short conversation that only copies: the task, its input files read, the right answer written,
        the final reply — no system prompt, no tool schemas, no check, never a mistake (~70 tokens against a
        demonstration's ~450, so a step sees several times more copies)."""
        calls = solving_calls(task, task.solution, self.commands)
        messages = [{"role": "user", "content": task.prompt}, *self._play(task, calls),
                    {"role": "assistant", "content": FINAL_ANSWER.format(answer=task.solution)}]
        return {"messages": messages, "task_id": task.id, "correct": True}

    def first_read(self, task: FamilyTask) -> dict[str, Any]:
        """The opening of a demonstration, cut after its first call (reading the file the prompt names), in the
        harness's own context (system prompt and tool schemas): a drill for the choice a policy gets wrong when
        it guesses the file from the family instead of reading the prompt. A copy drill has no system prompt,
        and what it teaches about the file name did not carry over to that context (#29, twelfth attempt)."""
        messages = [{"role": "system", "content": self.agent.SYSTEM_PROMPT}, {"role": "user", "content": task.prompt},
                    _assistant_call(0, *solving_calls(task, task.solution, self.commands)[0])]
        return {"messages": messages, "tools": self.tools, "task_id": task.id, "correct": True}

    def _play(self, task: FamilyTask, calls: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        """The assistant turns making ``calls`` and the real results of the workspace tools on ``task``'s files."""
        messages: list[dict[str, Any]] = []
        with tempfile.TemporaryDirectory(prefix="gyre-expert-") as root:
            workspace = self.tools_module.WorkspaceTools(Path(root))
            for name, content in task.files.items():
                (Path(root) / name).write_text(content)
            for i, (name, arguments) in enumerate(calls):
                messages.append(_assistant_call(i, name, arguments))
                messages.append({"role": "tool", "tool_call_id": f"call_{i}",
                                 "content": workspace.call(name, arguments)})
        return messages


def _assistant_call(i: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The assistant turn making the conversation's ``i``-th tool call (OpenAI format, id ``call_{i}``)."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def answer_turn(messages: list[dict[str, Any]]) -> int:
    """The index of a demonstration's assistant turn that writes the answer file (`answer_call`, the first call
    after the reads): where the probes of a warm start read what the policy would write."""
    return next(i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("tool_calls")
                and m["tool_calls"][0]["function"]["name"] != "read_file")


def family_tasks(tasks_path: Path) -> list[FamilyTask]:
    """The tasks of a generated task set, rebuilt as `FamilyTask`s (with their solutions)."""
    out = []
    for task in TaskSet.load(tasks_path):
        task_id, spec = task.id, task.spec
        family = task_id.split("-")[1]
        solution = str(spec.grading["reference"]) if family == "pyfunc" else str(spec.grading["expected"])
        out.append(FamilyTask(task_id, family, spec.prompt, dict(spec.files), spec.answer_file,
                              dict(spec.grading), solution, tuple(spec.files)))  # files: inputs, in order
    return out


def to_anthropic(record: dict[str, Any]) -> dict[str, Any]:
    """The same conversation in the Anthropic Messages format (system apart, tool_use / tool_result blocks)."""
    system, out = "", []
    for m in record["messages"]:
        if m["role"] == "system":
            system = m["content"]
        elif m["role"] == "user":
            out.append({"role": "user", "content": m["content"]})
        elif m["role"] == "assistant":
            blocks: list[dict[str, Any]] = [{"type": "text", "text": m["content"]}] if m["content"] else []
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"])} for c in m.get("tool_calls", [])]
            out.append({"role": "assistant", "content": blocks})
        elif m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in record["tools"]]
    return {"system": system, "messages": out, "tools": tools, "task_id": record["task_id"]}


def write_demonstrations(tasks_path: Path | None, out: Path, *, per_task: int, seed: int, error_rate: float,
                         fresh: int = 0, other_names: float = 0.0, anthropic: bool = False,
                         commands: tuple[str, ...] = ("add",), error_rates: Mapping[str, float] | None = None) -> int:
    """``per_task`` demonstrations of each task of ``tasks_path`` and one of each of ``fresh`` new tasks of the
    training distribution (`fresh_training_tasks`; a share ``other_names`` of them on randomly named files), the
    families of ``commands`` solved with a command, ``error_rates`` overriding ``error_rate`` per family."""
    expert = Expert(error_rate=error_rate, seed=seed, commands=commands, error_rates=error_rates)
    out.parent.mkdir(parents=True, exist_ok=True)
    listed = family_tasks(tasks_path) if tasks_path is not None else []
    plan = [task for task in listed for _ in range(per_task)] + fresh_training_tasks(fresh, seed, other_names)
    with out.open("w") as f:
        for task in plan:
            record = expert.demonstrate(task)
            f.write(json.dumps(to_anthropic(record) if anthropic else record) + "\n")
    return len(plan)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks", type=Path, help="a task set written by gyre.sft.families")
    parser.add_argument("out", type=Path, help="JSONL file of demonstrations")
    parser.add_argument("--per-task", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--error-rate", type=float, default=0.3)
    parser.add_argument("--fresh", type=int, default=0, help="also demonstrate this many new training-split tasks")
    parser.add_argument("--other-names", type=float, default=0.0,
                        help="share of the fresh tasks that read a randomly named file")
    parser.add_argument("--commands", nargs="+", default=["add"], choices=COMMAND_FAMILIES,
                        help="the families solved with a command that writes the answer file")
    parser.add_argument("--format", choices=("openai", "anthropic"), default="openai")
    args = parser.parse_args(argv)
    n = write_demonstrations(args.tasks, args.out, per_task=args.per_task, seed=args.seed,
                             error_rate=args.error_rate, fresh=args.fresh, other_names=args.other_names,
                             anthropic=args.format == "anthropic", commands=tuple(args.commands))
    print(f"{args.out}: {n} demonstrations")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
