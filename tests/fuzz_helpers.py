"""Hypothesis strategies for fuzzing JSON endpoints: arbitrary JSON, and near-valid bodies that keep a
template's shape while any field may be dropped, replaced by anything, or joined by unknown ones."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
"""Bounded and derandomised: the same examples on every run, fast enough for `make test`."""

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats(allow_nan=False)
           | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def near(template: Any) -> st.SearchStrategy[Any]:
    """Values shaped like `template`: each part kept (mostly), given another value of its type (edge cases:
    negative, huge, empty, unicode), replaced by arbitrary JSON, or (in an object) dropped."""
    if isinstance(template, dict) and template:
        keys = list(template)

        def drop_one(value: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
            return st.sampled_from([None] * (4 * len(keys)) + keys).map(
                lambda k: {key: v for key, v in value.items() if key != k})

        shaped: st.SearchStrategy[Any] = st.fixed_dictionaries({k: near(v) for k, v in template.items()}).flatmap(
            drop_one)
    elif isinstance(template, list) and template:
        items = [near(item) for item in template]
        shaped = st.tuples(*items).map(list) | st.lists(st.one_of(*items), max_size=4)
    else:
        shaped = st.just(template)
    variants = (shaped, _same_type(template), json_values)
    # 12 in 14 kept in shape; a weighted draw, not one_of(shaped * 12), whose repr grows as 12 ** depth
    return st.integers(0, 13).flatmap(lambda i: variants[0 if i < 12 else i - 11])


def _same_type(template: Any) -> st.SearchStrategy[Any]:
    if isinstance(template, bool):
        return st.booleans()
    if isinstance(template, int):
        return st.integers(-3, 3) | st.integers(-(2**70), 2**70)
    if isinstance(template, float):
        return st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([0.0, -1.0, 1e308, 2.0])
    if isinstance(template, str):
        return st.text(max_size=16) | st.sampled_from(["", "\x00", "user", "assistant", "system", "tool"])
    return json_values


def bodies(template: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """Request bodies: near-valid JSON mostly, some arbitrary JSON, some bytes that are not JSON at all."""
    encoded = near(template).map(lambda v: json.dumps(v).encode())
    return st.one_of(encoded, encoded, encoded, st.binary(max_size=64))
