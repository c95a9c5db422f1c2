"""Stateful Responses within an execution: `store`, `previous_response_id` and `item_reference`.

The proxy already holds each execution's conversation as exact ids; this keeps, per execution, the items of
its recent stored responses (what the request's history and input resolved to, plus the response's output),
so that a request naming one continues it. The conversation rendered is the same as if the harness had sent
the whole history itself, so the call tree is unchanged. `instructions` are not carried over (the API's rule).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from gyre.proxy.errors import ApiError

STORED_RESPONSES = 16
"""Stored responses kept per execution (the oldest is forgotten first; naming it is then a 400). Each holds
its whole history (shared with the response it continued, copied for a client that resends it), so memory is
at most this many histories per execution; chaining needs only the latest."""


class ResponseStore:
    def __init__(self, limit: int = STORED_RESPONSES) -> None:
        self.limit = limit
        self._responses: OrderedDict[str, tuple[dict[str, Any], ...]] = OrderedDict()

    def expand(self, previous_response_id: str | None, items: list[Any]) -> list[tuple[str, Any]]:
        """(where, item) for the stored response's items, then `items` with each `item_reference` replaced by
        the stored item it names."""
        entries: list[tuple[str, Any]] = []
        if previous_response_id is not None:
            stored = self._responses.get(previous_response_id)
            if stored is None:
                raise ApiError(
                    "invalid_request",
                    f"previous response {previous_response_id!r} not found: it was not stored (store=false), is "
                    f"older than the last {self.limit} of this execution, or belongs to another one",
                    "previous_response_id",
                )
            entries += [(f"previous_response_id.{i}", item) for i, item in enumerate(stored)]
        for i, item in enumerate(items):
            if isinstance(item, dict) and item.get("type") == "item_reference":
                entries.append((f"input.{i}", self._item(item.get("id"), f"input.{i}.id")))
            else:
                entries.append((f"input.{i}", item))
        return entries

    def keep(self, response_id: str, items: list[Any]) -> None:
        self._responses[response_id] = tuple(items)
        while len(self._responses) > self.limit:
            self._responses.popitem(last=False)

    def _item(self, item_id: object, where: str) -> dict[str, Any]:
        for stored in reversed(self._responses.values()):
            for item in stored:
                if isinstance(item, dict) and item.get("id") == item_id and item.get("type") != "item_reference":
                    return item
        raise ApiError("invalid_request", f"item {item_id!r} is not in a stored response of this execution", where)
