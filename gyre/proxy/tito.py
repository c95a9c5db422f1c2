"""Token-in/token-out bookkeeping for one execution: which recorded ids a new request extends.

Every call's exact ids are kept once, as a segment after a prefix of its parent (`prefix_len` tokens of the
parent's prompt + output), the way `model_call_finished` stores them. A trie over rendered *units* (see
`gyre.proxy.render`) indexes them: a node is the conversation rendered up to the end of one unit, and knows
a call whose sequence passes through it (`owner`) and how many of that call's tokens that is (`end`). All
calls that pass through a node agree on the ids up to it, so the ids of any matched path are a slice of
the owner's sequence and are never re-encoded. A *reply* node is the assistant turn a call produced; it
belongs to the call that produced it, and only a reply node can make a call a parent: a request whose units
run through call C's reply extends C's prompt + output and becomes C's child. Anything else is a new root
(whose prompt still reuses the exact ids of any matched prefix).

Drift: when the echoed assistant turn differs from what the model wrote (the harness edited it, a stop
sequence was trimmed, whitespace-only text was dropped), the echo is matched against the recorded output
text-first: the longest prefix of output tokens whose text the echo starts with is reused (`prefix_len`),
and the rest of the echo is rendered anew; the recorded tokens not reused are the call's `drift_tokens`.

Pure data structure: no I/O, no clock, no locks (the proxy calls it from its event loop only).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gyre.proxy.render import Unit

REPLACEMENT_CHAR = "\ufffd"


class Codec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class CallRecord:
    """One call's place in the tree: parent, `prefix_len`, and its own tokens (prompt delta, then output)."""

    __slots__ = (
        "agent",
        "branch",
        "call_id",
        "finished",
        "gen_node",
        "parent",
        "prefix_len",
        "prompt_len",
        "tokens",
        "wire",
    )

    def __init__(
        self,
        call_id: str,
        parent: CallRecord | None,
        prefix_len: int,
        delta: Iterable[int],
        branch: str = "main",
        agent: object = None,
    ) -> None:
        self.call_id = call_id
        self.parent = parent
        self.prefix_len = prefix_len
        self.tokens = array("i", delta)
        self.prompt_len = prefix_len + len(self.tokens)
        self.branch = branch
        self.agent = agent
        self.gen_node: Node | None = None
        self.finished = False
        self.wire: object = None
        """Free for a transport to cache its encoding of a prefix of `tokens` (only ever appended to)."""

    @property
    def delta(self) -> array:
        return self.tokens[: self.prompt_len - self.prefix_len]

    @property
    def output(self) -> array:
        return self.tokens[self.prompt_len - self.prefix_len :]

    @property
    def full_len(self) -> int:
        return self.prefix_len + len(self.tokens)

    def spans(self, start: int = 0, stop: int | None = None) -> list[tuple[CallRecord, int, int]]:
        """Tokens [start, stop) of this call's full sequence as (call, lo, hi) ranges of calls' own tokens."""
        upto = self.full_len if stop is None else stop
        spans: list[tuple[CallRecord, int, int]] = []
        rec: CallRecord | None = self
        while rec is not None and upto > start:
            if upto > rec.prefix_len:
                spans.append((rec, max(start, rec.prefix_len) - rec.prefix_len, upto - rec.prefix_len))
                upto = rec.prefix_len
            rec = rec.parent
        spans.reverse()
        return spans

    def segments(self, start: int = 0, stop: int | None = None) -> list[array]:
        """Tokens [start, stop) of this call's full sequence, as slices of the calls' own segments."""
        return [rec.tokens[lo:hi] for rec, lo, hi in self.spans(start, stop)]

    def ids(self, start: int = 0, stop: int | None = None) -> array:
        out = array("i")
        for piece in self.segments(start, stop):
            out.extend(piece)
        return out


class Node:
    """The conversation rendered up to the end of one unit (see the module docstring)."""

    __slots__ = ("children", "drift", "end", "extra", "owner", "reply")

    def __init__(
        self, owner: CallRecord | None, end: int, *, reply: bool = False, extra: tuple[int, ...] = (), drift: int = 0
    ) -> None:
        self.children: dict[str, Node] = {}
        self.owner = owner
        self.end = end
        self.reply = reply
        self.extra = extra
        self.drift = drift

    @property
    def depth(self) -> int:
        """Tokens on the path up to and including this node."""
        return self.end + len(self.extra)


@dataclass(frozen=True, slots=True)
class Alignment:
    """How an assistant turn's text lines up with a call's recorded output."""

    reused: int
    """Leading output tokens whose text the turn starts with."""
    extra: tuple[int, ...]
    """The rest of the turn, encoded."""
    drift: int
    """Recorded output tokens not reused."""


@dataclass(slots=True)
class Plan:
    """Where a request attaches and the ids it adds; `CallTree.start` turns it into a call."""

    parent: CallRecord | None
    prefix_len: int
    delta: array
    drift: int
    anchor: Node
    new_units: list[Unit]
    new_ids: list[list[int]]
    realigned: tuple[Node, str, Node] | None = None
    """(GEN node, echoed turn text, new reply node) when the echo matched no recorded turn exactly."""

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + len(self.delta)


class CallTree:
    """All calls of one execution and the unit trie that finds a request's parent."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.root = Node(None, 0)
        self.calls: dict[str, CallRecord] = {}

    # -- planning --------------------------------------------------------------------------------------

    def plan(self, units: Sequence[Unit]) -> Plan:
        """Match `units` against the trie; read-only, O(units) lookups plus encoding of the new units."""
        node = self.root
        reply: Node | None = None
        i = 0
        realigned: tuple[Node, str, Node] | None = None
        while i < len(units):
            unit = units[i]
            child = node.children.get(unit.text)
            if child is None:
                fixed = self._realign(node, unit.text) if unit.kind == "body" else None
                if fixed is not None:
                    realigned = (node, unit.text, fixed)
                    node = reply = fixed
                    i += 1
                break
            node = child
            if child.reply:
                reply = child
            i += 1
        new_units = list(units[i:])
        new_ids = self.codec.encode_many([u.text for u in new_units]) if new_units else []
        delta = array("i")
        if reply is not None:
            assert reply.owner is not None
            parent, prefix_len, drift = reply.owner, reply.end, reply.drift
            delta.extend(reply.extra)
            start = reply.depth
        else:
            parent, prefix_len, drift, start = None, 0, 0, 0
        if node is not reply and node.owner is not None and node.end > start:
            for piece in node.owner.segments(start, node.end):
                delta.extend(piece)
        for ids in new_ids:
            delta.extend(ids)
        return Plan(parent, prefix_len, delta, drift, node, new_units, new_ids, realigned)

    def _realign(self, gen: Node, text: str) -> Node | None:
        """A reply node for an echoed turn that matches none exactly: aligned with the closest recorded output."""
        best: tuple[Alignment, CallRecord] | None = None
        for child in gen.children.values():
            if not child.reply or child.owner is None:
                continue
            alignment = self.align(child.owner.output, text)
            if best is None or alignment.reused >= best[0].reused:
                best = (alignment, child.owner)
        if best is None:
            return None
        alignment, owner = best
        return Node(
            owner, owner.prompt_len + alignment.reused, reply=True, extra=alignment.extra, drift=alignment.drift
        )

    def align(self, output: Sequence[int], text: str) -> Alignment:
        """Longest prefix of `output` whose decoded text `text` starts with (never mid-character)."""
        decode = self.codec.decode

        def fits(m: int) -> str | None:
            prefix = decode(output[:m]) if m else ""
            if text.startswith(prefix) and not prefix.endswith(REPLACEMENT_CHAR):
                return prefix
            return None

        n = len(output)
        whole = fits(n)
        if whole is not None:
            m, prefix = n, whole
        else:
            lo, hi = 0, n - 1
            while lo < hi:  # largest m that fits, assuming fitting is monotone (it is, up to partial chars)
                mid = (lo + hi + 1) // 2
                if fits(mid) is not None:
                    lo = mid
                else:
                    hi = mid - 1
            m = lo
            for k in range(min(n - 1, lo + 4), lo, -1):  # a partial char can hide a longer fit just above
                if fits(k) is not None:
                    m = k
                    break
            prefix = fits(m) or ""
        rest = text[len(prefix) :]
        return Alignment(m, tuple(self.codec.encode(rest)) if rest else (), n - m)

    # -- recording -------------------------------------------------------------------------------------

    def start(self, plan: Plan, call_id: str, *, branch: str = "main", agent: object = None) -> CallRecord:
        """Create the call a plan describes and index its new units. Call right after `plan` (no await)."""
        if call_id in self.calls:
            raise ValueError(f"call id {call_id!r} is already recorded in this execution")
        record = CallRecord(call_id, plan.parent, plan.prefix_len, plan.delta, branch=branch, agent=agent)
        node = plan.anchor
        if plan.realigned is not None:
            gen, key, reply = plan.realigned
            node = gen.children.setdefault(key, reply)
        end = record.prompt_len - sum(len(ids) for ids in plan.new_ids)
        for unit, ids in zip(plan.new_units, plan.new_ids, strict=True):
            end += len(ids)
            child = Node(record, end)
            node = node.children.setdefault(unit.text, child)
        record.gen_node = node
        self.calls[call_id] = record
        return record

    def finish(self, record: CallRecord, output_ids: Sequence[int], reply_text: str | None) -> Alignment | None:
        """Store the output; index the turn as the harness was shown it (`reply_text`, None if never shown)."""
        record.tokens.extend(output_ids)
        record.finished = True
        if reply_text is None or record.gen_node is None:
            return None
        alignment = self.align(output_ids, reply_text)
        node = Node(
            record, record.prompt_len + alignment.reused, reply=True, extra=alignment.extra, drift=alignment.drift
        )
        record.gen_node.children.setdefault(reply_text, node)
        return alignment
