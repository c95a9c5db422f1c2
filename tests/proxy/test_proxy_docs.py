"""docs/proxy.md's feature rules and compatibility matrix name the test behind each entry: every named test
exists, so an entry cannot outlive (or precede) its evidence."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("## Responses: the rule per feature", "## Compatibility matrix")


def _tests() -> dict[str, set[str]]:
    """Test file name -> the test functions it defines."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        tree = ast.parse(path.read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
        found.setdefault(path.name, set()).update(names)
    return found


def test_every_test_the_matrix_names_exists() -> None:
    text = (ROOT / "docs" / "proxy.md").read_text()
    start = text.index(SECTIONS[0])
    section = text[start : text.index("\n## ", text.index(SECTIONS[1]) + 1)]
    tests = _tests()
    every = set().union(*tests.values())
    named = re.findall(r"`(?:(test_\w+\.py)::)?(test_\w+)(?:\[[^\]]*\])?`", section)
    assert len(named) > 40
    missing = [f"{file}::{name}" for file, name in named
               if (name not in tests.get(file, set()) if file else name not in every)]
    assert not missing, missing
    for table in section.split("\n\n"):
        rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("|---")][1:]
        for row in rows:  # every entry of a table row is backed: a named test, or says it is not there
            assert re.search(r"test_\w+|n/a|not (tested|supported|used)|none in|—", row), row
