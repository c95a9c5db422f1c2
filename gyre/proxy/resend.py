"""Reading a re-sent conversation: only the messages new since the execution's last request are validated.

A harness re-sends the whole conversation on every call, so validating and translating all of it costs
O(context) per call, most of it work already done for the same bytes one call earlier. An execution keeps
the message array of its last few requests (`ResendCache`, the text as sent and what each element was
translated into); a new request whose array starts with the same bytes element by element reuses those
elements' translations, and only the rest of the body is validated, by the same pydantic model, with the
reused elements left out of the array.

Exactly correct, not a heuristic: an element is reused only when its text, separators included, is the
very text validated and translated before (JSON objects are self-delimiting, so equal text is the same
element); an element that changed, anywhere, is validated and translated anew, and so is everything after
it. Validation and translation of an element depend only on its own text (the front ends check that by
translating element by element), so the result is the one the whole body would give. Anything unexpected
(a body that is not a JSON object, the array missing or given twice, an element that is not an object, a
validation error) falls back to validating the whole body, which also gives the error its usual wording.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from gyre.proxy.errors import ApiError

M = TypeVar("M", bound=BaseModel)

_WS = json.decoder.WHITESPACE.match  # type: ignore[attr-defined]
_DECODER = json.JSONDecoder()
KEEP = 4
"""Arrays remembered per execution: its agents (a main conversation and sub-agents) interleave calls."""


class _Unusable(Exception):
    """The body is not laid out as expected: validate it whole."""


@dataclass(slots=True)
class _Seen:
    """One request's array, as sent, and its elements' translations."""

    model: type[BaseModel]
    before: bytes
    """The body up to and including the array's `[`."""
    after: bytes
    """The body from the array's `]` on."""
    head: bytes
    """The array from its `[` through the end of its last element."""
    ends: list[int]
    """Offsets in `head` just past each element."""
    items: list[Any]


class ResendCache:
    """The message arrays an execution sent last (`KEEP`, most recent first)."""

    def __init__(self) -> None:
        self._seen: list[_Seen] = []

    def _of(self, model: type[BaseModel]) -> list[_Seen]:
        return [seen for seen in self._seen if seen.model is model]

    def _keep(self, seen: _Seen, replaces: _Seen | None) -> None:
        rest = [s for s in self._seen if s is not replaces]
        self._seen = [seen, *rest][:KEEP]


@dataclass(slots=True)
class Resent(Generic[M]):
    """A validated body whose array holds only the elements after `start`; `earlier` are the translations
    of the first `start` elements, as remembered. Call `remember` with the translations of the new ones."""

    body: M
    start: int
    earlier: list[Any]
    _remember: Callable[[list[Any]], None] | None = None

    def remember(self, items: list[Any]) -> None:
        """Keep this array for the execution's next request (`items`: the new elements' translations)."""
        if self._remember is not None:
            self._remember(items)


def read_resent(
    raw: bytes, model: type[M], field: str, cache: ResendCache, validate: Callable[[bytes], M]
) -> Resent[M]:
    """`raw` validated by `validate` (the model's usual validation, raising `ApiError`), its array `field`
    cut to what `cache` has not seen; see the module docstring."""
    try:
        return _read(raw, model, field, cache, validate)
    except (_Unusable, ApiError, UnicodeDecodeError, ValueError, IndexError):
        pass
    body = validate(raw)  # the whole body: the result (or error) the harness would get without the cache
    return Resent(body, 0, [], _whole(raw, model, field, cache))


def _read(raw: bytes, model: type[M], field: str, cache: ResendCache, validate: Callable[[bytes], M]) -> Resent[M]:
    """The cut read; byte offsets throughout (the body is decoded only where it is parsed, past what is
    reused, so a long conversation costs a few memcmp and one copy of what is kept)."""
    seen = cache._of(model)
    at = _array_at(raw, field, seen)
    best, start = None, 0
    for candidate in seen:
        k = _reused(raw, at, candidate)
        if k > start:
            best, start = candidate, k
    while True:
        head_end = at + best.ends[start - 1] if best is not None and start else at + 1
        starts, ends, stop = _elements(raw, head_end, first=start == 0)
        if starts or start == 0:
            break
        start -= 1  # nothing new (a retry): the last element is validated again, so the array is never empty
    if not starts:
        raise _Unusable("an empty array")
    if not any(len(raw) - stop + 1 == len(s.after) and raw.endswith(s.after) for s in seen):
        _check_rest(raw, stop, field)  # a tail not seen before: the array must be the only `field`
    body = validate(raw[: at + 1] + raw[starts[0] : stop] + raw[stop:])
    earlier = best.items[:start] if best is not None else []
    offsets = [*(best.ends[:start] if best is not None else []), *(e - at for e in ends)]

    def remember(items: list[Any]) -> None:
        if len(items) != len(starts):
            raise ValueError(f"{len(items)} translations for {len(starts)} new elements")
        cache._keep(_Seen(model, raw[: at + 1], raw[stop - 1 :], raw[at : at + offsets[-1]], offsets,
                          [*earlier, *items]), best)

    return Resent(body, start, earlier, remember)


def _bytes_at(text: str, positions: list[int]) -> list[int]:
    """Ascending character offsets in `text` as offsets in its UTF-8 encoding."""
    if text.isascii():
        return positions
    out, size, done = [], 0, 0
    for p in positions:
        size += len(text[done:p].encode())
        done = p
        out.append(size)
    return out


def _array_at(raw: bytes, field: str, seen: Sequence[_Seen]) -> int:
    """Where the top-level `field` array's `[` is: where a remembered body's is, when this body starts with
    the same bytes; else found by walking the object's keys (values before it are skipped by parsing)."""
    for candidate in seen:
        if raw.startswith(candidate.before):
            return len(candidate.before) - 1
    text = raw.decode()
    i = _WS(text, 0).end()
    if text[i] != "{":
        raise _Unusable("not an object")
    i = _WS(text, i + 1).end()
    while True:
        key, i = _key(text, i)
        if key == field:
            if text[i] != "[":
                raise _Unusable(f"{field} is not an array")
            return _bytes_at(text, [i])[0]
        _, i = _DECODER.raw_decode(text, i)
        i = _WS(text, i).end()
        if text[i] != ",":
            raise _Unusable(f"no {field}")
        i = _WS(text, i + 1).end()


def _key(text: str, i: int) -> tuple[str, int]:
    """The key at `i` and where its value starts."""
    if text[i] != '"':
        raise _Unusable("a key is not a string")
    key, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
    i = _WS(text, i).end()
    if text[i] != ":":
        raise _Unusable("no colon")
    return key, _WS(text, i + 1).end()


def _check_rest(raw: bytes, stop: int, field: str) -> None:
    """The body after the array (from byte `stop`): more keys, none of them `field` again, then the
    object's end."""
    text = raw[stop:].decode()
    i = 0
    while True:
        i = _WS(text, i).end()
        if text[i] == "}":
            if _WS(text, i + 1).end() != len(text):
                raise _Unusable("text after the object")
            return
        if text[i] != ",":
            raise _Unusable("no comma")
        key, i = _key(text, _WS(text, i + 1).end())
        if key == field:
            raise _Unusable(f"{field} twice")
        _, i = _DECODER.raw_decode(text, i)


def _reused(raw: bytes, at: int, seen: _Seen) -> int:
    """How many leading elements of the array at `at` are, separators included, those of `seen`."""
    if raw.startswith(seen.head, at):
        return len(seen.ends)
    k = done = 0
    for end in seen.ends:
        if not raw.startswith(seen.head[done:end], at + done):
            break
        k, done = k + 1, end
    return k


def _elements(raw: bytes, offset: int, *, first: bool) -> tuple[list[int], list[int], int]:
    """Byte offsets of the starts and ends of the array's elements from `offset` (just past the `[` when
    `first`, else just past an element), and of just past its `]`. Every element must be an object."""
    text = raw[offset:].decode()  # `offset` follows `[` or `}`: a character boundary
    starts: list[int] = []
    ends: list[int] = []
    i = _WS(text, 0).end()
    if text[i] != "]":
        if not first:
            if text[i] != ",":
                raise _Unusable("no comma")
            i = _WS(text, i + 1).end()
        while True:
            if text[i] != "{":
                raise _Unusable("an element is not an object")
            _, end = _DECODER.raw_decode(text, i)
            starts.append(i)
            ends.append(end)
            i = _WS(text, end).end()
            if text[i] == "]":
                break
            if text[i] != ",":
                raise _Unusable("no comma")
            i = _WS(text, i + 1).end()
    positions = _bytes_at(text, [p for pair in zip(starts, ends, strict=True) for p in pair] + [i + 1])
    return [offset + p for p in positions[0:-1:2]], [offset + p for p in positions[1:-1:2]], offset + positions[-1]


def _whole(raw: bytes, model: type[BaseModel], field: str, cache: ResendCache) -> Callable[[list[Any]], None]:
    """`remember` for a body validated whole: its layout is found afterwards, when it has one."""

    def remember(items: list[Any]) -> None:
        try:
            at = _array_at(raw, field, ())
            starts, ends, stop = _elements(raw, at + 1, first=True)
            _check_rest(raw, stop, field)
        except (_Unusable, UnicodeDecodeError, ValueError, IndexError):
            return
        if not starts or len(items) != len(starts):
            return
        offsets = [e - at for e in ends]
        cache._keep(_Seen(model, raw[: at + 1], raw[stop - 1 :], raw[at : at + offsets[-1]], offsets, items), None)

    return remember
