"""Parameterised task families with a training split and a held-out split, graded by the toy grader.

Every task puts its input in a file, so solving it takes tool calls: read the input, write the answer, check
it, answer. Six families (copying a word, string transforms, arithmetic, a small Python function checked by
unit tests, a two-file edit), each over file names and words drawn from a seeded generator. The held-out split has words
and numbers the training split never uses (unseen parameters) and family x file-name pairs it never pairs
(unseen combinations).

    python -m gyre.sft.families tasks/toy    # writes learn-train.toml and learn-heldout.toml (checked in)

The task set lives beside `tasks/toy/evaluate.py` so its command evaluator (`{taskset_dir}/evaluate.py`) is the
existing one and is visible inside the evaluator's sandbox.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FAMILIES = ("copy", "upper", "reverse", "add", "pyfunc", "concat")
INPUT_FILES = ("input.txt", "data.txt", "word.txt")
HELDOUT_PAIRS = {("copy", "data.txt"), ("upper", "word.txt"), ("reverse", "data.txt"), ("add", "input.txt")}
"""Family x input-file combinations that only the held-out split has."""
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pe", "sa", "do", "fu")


@dataclass(frozen=True)
class FamilyTask:
    """One generated task: what the agent is told and given, what the grader checks, and the right answer."""

    id: str
    family: str
    prompt: str
    files: dict[str, str]
    answer_file: str
    grading: dict[str, Any]
    solution: str
    """The correct content of `answer_file` (the expert writes it, or a plausible mistake)."""
    inputs: tuple[str, ...] = field(default=())
    """The files to read, in order."""


DRILL_FAMILIES = ("copy", "upper", "reverse", "concat")
"""The families whose answer is the input rewritten letter by letter: what a copy drill exercises by default (and
what the written-letter check measures)."""
COPYING_FAMILIES = (*DRILL_FAMILIES, "pyfunc", "add")
"""Every family whose answer copies what a tool returned: the input files (pyfunc's K into a fixed template), or
the sum a command computed (add, `gyre.sft.expert.SUM_COMMAND`). What a drill may exercise."""
COMMAND_FAMILIES = ("add", "reverse", "concat")
"""The families the scripted expert can solve with a shell command writing the answer file (`gyre.sft.expert`;
add always does)."""
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))


def _letters(rng: random.Random) -> str:
    """A random string of letters: nothing in it can be predicted except by reading it."""
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 8)))


def make_task(task_id: str, family: str, source: str, rng: random.Random,
              word: Callable[[random.Random], str] = _word) -> FamilyTask:
    """A task of ``family`` reading ``source`` (concat reads two files), parameters from ``rng``, words from
    ``word``. Every prompt names its file after " in", never first: a sentence-initial name is another token
    sequence (the BPE merges "data" at a line's start, " d" "ata" inside one), and the tiny policy never learned
    to copy it from there (#29, twelfth attempt: it read one of the three files at random)."""
    if family in ("copy", "upper", "reverse"):
        word = word(rng)
        how = {"copy": "unchanged", "upper": "in capital letters", "reverse": "spelled backwards"}[family]
        solution = {"copy": word, "upper": word.upper(), "reverse": word[::-1]}[family]
        return FamilyTask(task_id, family, f"Write the word in {source} {how} into answer.txt.",
                          {source: word + "\n"}, "answer.txt", {"kind": "text", "expected": solution}, solution,
                          (source,))
    if family == "add":
        a, b = rng.randint(1, 49), rng.randint(1, 49)
        return FamilyTask(task_id, family, f"Two numbers are in {source}. Write their sum into answer.txt.",
                          {source: f"{a} {b}\n"}, "answer.txt", {"kind": "text", "expected": str(a + b)},
                          str(a + b), (source,))
    if family == "pyfunc":
        k = rng.randint(2, 9)
        solution = f"def f(x):\n    return x * {k}\n"
        checks = [f"f({x}) == {x * k}" for x in (0, 1, 3, 7)]
        return FamilyTask(task_id, family, f"A number K is in {source}. Write solution.py defining f(x) that "
                                           "returns x times K.", {source: f"{k}\n"}, "solution.py",
                          {"kind": "python", "checks": checks, "reference": solution}, solution, (source,))
    if family == "concat":
        first, second = word(rng), word(rng)
        other = "b.txt"
        return FamilyTask(task_id, family, f"Write the word in {source}, a space, then the word in {other} "
                                           "into answer.txt.", {source: first + "\n", other: second + "\n"},
                          "answer.txt", {"kind": "text", "expected": f"{first} {second}"}, f"{first} {second}",
                          (source, other))
    raise ValueError(f"unknown family {family!r}; families: {', '.join(FAMILIES)}")


def parameters(task: FamilyTask) -> set[str]:
    """The words and numbers a task is about, to keep the held-out split's unseen."""
    return {v.strip() for v in task.files.values()} | set(next(iter(task.files.values())).split())


def generate(seed: int = 0, train_per_pair: int = 6, heldout_per_pair: int = 3) -> tuple[list[FamilyTask],
                                                                                        list[FamilyTask]]:
    """(training tasks, held-out tasks): every family x file pair, held-out parameters never seen in training."""
    rng = random.Random(seed)
    train: list[FamilyTask] = []
    heldout: list[FamilyTask] = []
    seen: set[str] = set()
    for family in FAMILIES:
        for source in INPUT_FILES:
            stem = source.removesuffix(".txt")
            if (family, source) not in HELDOUT_PAIRS:
                for i in range(train_per_pair):
                    task = make_task(f"train-{family}-{stem}-{i}", family, source, rng)
                    train.append(task)
                    seen |= parameters(task)
    for family in FAMILIES:
        for source in INPUT_FILES:
            stem = source.removesuffix(".txt")
            made = 0
            while made < heldout_per_pair:
                task = make_task(f"heldout-{family}-{stem}-{made}", family, source, rng)
                if family != "pyfunc" and parameters(task) & seen:  # pyfunc has 8 values of K: new pairs only
                    continue
                heldout.append(task)
                made += 1
    return train, heldout


def _off_heldout(task: FamilyTask, unseen: set[str]) -> bool:
    """A training task's parameters stay off the held-out split's (pyfunc's K aside: it has 8 values, so its
    held-out tasks are new family x file pairs only)."""
    return task.family == "pyfunc" or not parameters(task) & unseen


def _heldout_parameters() -> set[str]:
    """The held-out split's words and numbers (pyfunc's K aside: it has 8 values), never used in training."""
    _, heldout = generate()
    return set().union(*(parameters(t) for t in heldout if t.family != "pyfunc"))


def _training_pairs(families: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(f, s) for f in families for s in INPUT_FILES if (f, s) not in HELDOUT_PAIRS]


RESERVED_NAMES = frozenset({*INPUT_FILES, "answer.txt", "solution.py", "b.txt"})


def other_name(rng: random.Random) -> str:
    """A random file name no task set uses (3-6 letters + ``.txt``). Training tasks pair each family with two of
    the three input files, and a policy that learns the pairing instead of reading the name the prompt gives
    fails the held-out split's unseen pairs (#29, thirteenth attempt: held-out copy of ``data.txt`` and sum of
    ``input.txt`` at 0% after RL); tasks over names like these can only be solved by copying the name."""
    while (name := "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6))) + ".txt") in RESERVED_NAMES:
        pass
    return name


def _renamer(seed: int, share: float) -> Callable[[str], str]:
    """``source`` -> itself, or with probability ``share`` an `other_name`. Its own generator: the tasks' draws
    (and so every set made with ``share`` 0, as before it existed) stay the same."""
    if not 0 <= share <= 1:
        raise ValueError(f"other_names {share}: a share, between 0 and 1")
    rng = random.Random(f"other-names-{seed}")
    return lambda source: other_name(rng) if share and rng.random() < share else source


def fresh_training_tasks(count: int, seed: int, other_names: float = 0.0) -> list[FamilyTask]:
    """``count`` new tasks from the training distribution (training family x file pairs, parameters never in
    the held-out split): what the expert demonstrates, so a policy learns the families, not 72 answers. A share
    ``other_names`` of them read a file of a random name (`other_name`) instead of the pair's."""
    unseen, pairs, rename = _heldout_parameters(), _training_pairs(FAMILIES), _renamer(seed, other_names)
    rng = random.Random(seed)
    out: list[FamilyTask] = []
    while len(out) < count:
        family, source = pairs[len(out) % len(pairs)]
        task = make_task(f"fresh-{family}-{len(out)}", family, rename(source), rng)
        if _off_heldout(task, unseen):
            out.append(task)
    return out


def drill_tasks(count: int, seed: int, families: tuple[str, ...] = DRILL_FAMILIES,
                other_names: float = 0.0) -> list[FamilyTask]:
    """``count`` copy drills: tasks of ``families`` (of `COPYING_FAMILIES`) over random letter strings, on the
    training split's family x file pairs only (a share ``other_names`` on a random file name instead). A
    syllable word can be half guessed from the family's word distribution; a random string can only be copied,
    so these teach the model to read the tool result (issue #29). A pyfunc drill copies its K, a digit the
    template cannot predict."""
    if unknown := set(families) - set(COPYING_FAMILIES):
        raise ValueError(f"drill families {sorted(unknown)}: a drill copies its input; "
                         f"families: {', '.join(COPYING_FAMILIES)}")
    unseen, pairs, rename = _heldout_parameters(), _training_pairs(families), _renamer(seed, other_names)
    rng = random.Random(seed)
    out: list[FamilyTask] = []
    while len(out) < count:
        family, source = pairs[rng.randrange(len(pairs))]
        task = make_task(f"drill-{family}-{len(out)}", family, rename(source), rng, word=_letters)
        if _off_heldout(task, unseen):
            out.append(task)
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # strings and numbers: JSON's escapes are valid TOML basic strings


def task_set_toml(split: str, tasks: list[FamilyTask]) -> str:
    lines = [
        "# Generated by `python -m gyre.sft.families tasks/toy`: do not edit by hand.",
        f"# The {split} split of the task families of the learning run (gyre.sft.families); the held-out split",
        "# has words and numbers the training split never uses, and family x file pairs it never pairs.",
        f'name = "toy-learn-{split}"',
        'description = "Six task families that need tool calls (copying, string transforms, sums, a Python '
        'function, two-file edits)."',
        "",
        "[evaluator]",
        'type = "command"',
        'name = "toy-grader"',
        'command = ["{python}", "{taskset_dir}/evaluate.py", "{grading_file}", "{workspace}"]',
        "timeout_s = 30",
    ]
    for task in tasks:
        lines += ["", "[[tasks]]", f"id = {json.dumps(task.id)}", f"prompt = {json.dumps(task.prompt)}",
                  f"answer_file = {json.dumps(task.answer_file)}", f"files = {_toml_value(task.files)}",
                  "[tasks.grading]", *(f"{k} = {_toml_value(v)}" for k, v in task.grading.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m gyre.sft.families DIR", file=sys.stderr)
        return 2
    for split, tasks in zip(("train", "heldout"), generate(), strict=True):
        path = Path(argv[0]) / f"learn-{split}.toml"
        path.write_text(task_set_toml(split, tasks))
        print(f"{path}: {len(tasks)} tasks")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
