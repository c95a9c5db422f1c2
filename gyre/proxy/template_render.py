"""A checkpoint's own chat template (Hugging Face jinja), rendered as units.

`ChatMLRenderer` reproduces the tiny template in Python: O(new text) per call. A real checkpoint brings its
own template (Qwen2.5's default system prompt and `\\n<tool_call>\\n...` layout, Qwen3's `<think>` handling),
which only its jinja source describes exactly. `TemplateRenderer` renders it with `apply_chat_template` and
cuts the text into units by rendering prefixes of the conversation:

- a cut after message k sits where the template's rendering of messages[:k] ends, if that rendering is a
  prefix of the whole prompt (a template may render a message differently once more follow: the closing of
  a run of tool results, Qwen3 dropping earlier `<think>`);
- an assistant turn k is cut into `gen` (what the generation prompt after messages[:k] adds) and `body`
  (up to and including the end-of-turn token that follows, the token the model stops on);
- a context cut is kept only where an added or special token sits on one side of it, so encoding unit by
  unit gives the ids of encoding the whole text; otherwise neighbouring units merge (correct, only coarser).

`rewritten` counts earlier assistant turns the template now renders differently from how it rendered them as
the turn's own prompt: such a turn's recorded output cannot be reused as is (drift, or a new root), and the
call's `model_call_started.rerendered_turns` says so. Exact ids are never faked.

Cost: the cuts of a conversation are remembered (by prefix, checked by digest), so a call that extends an
earlier one renders the template about twice per new message plus once whole: O(context) per call, not
O(messages x context). The native `ChatMLRenderer` stays O(new text).

`check_template` probes a template once (system, tools, tool calls, tool results, multi-turn) and raises
`TemplateError` naming what it cannot handle, so an unsuitable checkpoint is refused at start rather than
fed wrong ids.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gyre.proxy.conversation import Conversation, Message, ToolCall, ToolSpec
from gyre.proxy.errors import ProxyError
from gyre.proxy.output import TOOL_CLOSE, TOOL_OPEN, parse_tool_call
from gyre.proxy.render import ChatMLRenderer, ChatRenderer, Rendered, Rendering, Unit

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gyre.proxy.tokens import TokenCodec

_PROBE_TEXT = "Gyre probe 7"


class TemplateError(ProxyError, ValueError):
    """A chat template the proxy cannot render unit by unit (the message says what fails)."""


def template_messages(conversation: Conversation) -> list[dict[str, Any]]:
    """Messages as HF chat templates expect them: tool-call arguments as objects (Qwen2.5 `tojson`s them)."""
    out: list[dict[str, Any]] = []
    for m in conversation.messages:
        item: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            item["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_object()}}
                for c in m.tool_calls
            ]
        if m.reasoning:
            item["reasoning_content"] = m.reasoning
        out.append(item)
    return out


@dataclass(frozen=True, slots=True)
class _Cut:
    at: int
    kind: str  # kind of the unit that starts here


@dataclass(frozen=True, slots=True)
class _Memo:
    """A conversation prefix already cut: its rendering's length and digest, its cuts, turns rewritten."""

    length: int
    digest: bytes
    cuts: tuple[_Cut, ...]
    rewritten: int


MEMO_ENTRIES = 4096
"""Prefixes remembered (a few hundred bytes each): one per recent call, across concurrent executions."""


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _prefix_keys(conversation: Conversation) -> list[int]:
    """keys[k] identifies (tools, messages[:k]). Only a lookup key: a remembered prefix is used only if the
    prompt's text still starts with what it rendered (checked by digest), so a collision cannot change ids."""
    key = hash(tuple((t.name, t.description, json.dumps(t.parameters, sort_keys=True)) for t in conversation.tools))
    keys = [key]
    for m in conversation.messages:
        calls = tuple((c.id, c.name, c.arguments_json()) for c in m.tool_calls)
        key = hash((key, m.role, m.content, m.reasoning, calls))
        keys.append(key)
    return keys


class TemplateRenderer:
    """Units of a HF tokenizer's chat template (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template (tokenizer_config.json `chat_template`)")
        self.tokenizer = tokenizer
        self._memo: OrderedDict[int, _Memo] = OrderedDict()
        self.added = sorted({t.content for t in tokenizer.added_tokens_decoder.values()}, key=len, reverse=True)
        self.end_of_turn = self._probe_end_of_turn()
        self.tool_call_separator = self._probe_separator()

    # -- rendering -------------------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], tools: Sequence[ToolSpec], generation: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=[t.template_dict() for t in tools] or None,
                tokenize=False,
                add_generation_prompt=generation,
            )
        except Exception as e:  # jinja raises anything, including the template's own raise_exception
            raise TemplateError(f"the chat template failed to render: {e}") from e
        assert isinstance(text, str)
        return text

    def render(self, conversation: Conversation, kept: list[Rendered] | None = None) -> Rendering:
        """`kept` is not used: this renderer remembers prefixes itself, across executions (`_memo`)."""
        messages = template_messages(conversation)
        tools = conversation.tools
        n = len(messages)
        whole = self._render(messages, tools, True)
        keys = _prefix_keys(conversation)
        begin, cuts, rewritten, known = self._resume(keys, whole)
        rendered: dict[int, str | None] = {}

        def prefix(k: int) -> str | None:
            if k not in rendered:
                rendered[k] = self._safe_render(messages[:k], tools, False)
            return rendered[k]

        def prefix_end(k: int) -> int | None:
            if k == begin and known is not None:
                return known
            return self._prefix_end(whole, prefix(k))

        eot = self.end_of_turn
        for k in range(begin, n):
            if conversation.messages[k].role != "assistant":
                end = prefix_end(k + 1)
                if end is not None:
                    self._cut(cuts, whole, end, "context")
                continue
            start = prefix_end(k)
            if start is not None:
                self._cut(cuts, whole, start, "gen", force=True)
            gen_at = self._prefix_end(whole, self._safe_render(messages[:k], tools, True))
            body_end = whole.find(eot, gen_at) if gen_at is not None else -1
            if gen_at is None or body_end < 0:
                continue
            body_end += len(eot)
            alone = prefix(k + 1)
            if alone is None or alone[:body_end] != whole[:body_end]:
                rewritten += 1  # this turn, as its own prompt's continuation, rendered differently
            self._cut(cuts, whole, gen_at, "body", force=True)
            self._cut(cuts, whole, body_end, "context", force=True)
        last = prefix_end(n)
        if last is not None:
            self._remember(keys[n], whole, last, cuts, rewritten)
            if last < len(whole):
                self._cut(cuts, whole, last, "gen", force=True)
        units = []
        for cut, following in zip(cuts, [*cuts[1:], _Cut(len(whole), "")], strict=True):
            if following.at > cut.at:
                units.append(Unit(whole[cut.at : following.at], cut.kind))  # type: ignore[arg-type]
        if not units or units[-1].kind != "gen":
            raise TemplateError("the chat template's generation prompt could not be told apart from the history")
        return Rendering(units, rewritten)

    def _resume(self, keys: list[int], whole: str) -> tuple[int, list[_Cut], int, int | None]:
        """The longest remembered prefix of this conversation whose rendering `whole` still starts with:
        (messages done, their cuts, turns rewritten, where their rendering ends); else from scratch."""
        for k in range(len(keys) - 1, 0, -1):
            entry = self._memo.get(keys[k])
            if entry is not None and entry.length <= len(whole) and _digest(whole[: entry.length]) == entry.digest:
                self._memo.move_to_end(keys[k])
                return k, list(entry.cuts), entry.rewritten, entry.length
        return 0, [_Cut(0, "context")], 0, None

    def _remember(self, key: int, whole: str, length: int, cuts: list[_Cut], rewritten: int) -> None:
        """Keep the cuts of this conversation (without the generation prompt) for the call that extends it."""
        kept = tuple(c for c in cuts if c.at <= length)
        self._memo[key] = _Memo(length, _digest(whole[:length]), kept, rewritten)
        self._memo.move_to_end(key)
        while len(self._memo) > MEMO_ENTRIES:
            self._memo.popitem(last=False)

    def units(self, conversation: Conversation) -> list[Unit]:
        return self.render(conversation).units

    def _safe_render(self, messages: list[dict[str, Any]], tools: Sequence[ToolSpec], gen: bool) -> str | None:
        try:
            return self._render(messages, tools, gen)
        except TemplateError:  # a prefix the template refuses (e.g. no user turn yet): no cut there
            return None

    @staticmethod
    def _prefix_end(whole: str, part: str | None) -> int | None:
        return len(part) if part is not None and whole.startswith(part) else None

    def _cut(self, cuts: list[_Cut], whole: str, at: int, kind: str, *, force: bool = False) -> None:
        """Add a cut at `at` (after the last one); an unsafe context cut merges into the previous unit."""
        if at <= cuts[-1].at:
            if at == cuts[-1].at and force:
                cuts[-1] = _Cut(at, kind)
            return
        if force or self._safe(whole, at):
            cuts.append(_Cut(at, kind))

    def _safe(self, whole: str, at: int) -> bool:
        return any(whole.endswith(t, 0, at) or whole.startswith(t, at) for t in self.added)

    # -- the assistant turn ------------------------------------------------------------------------------

    def assistant_body(self, message: Message) -> str:
        """What the template renders for `message` as a reply to one user turn, end-of-turn token included."""
        user = {"role": "user", "content": _PROBE_TEXT}
        prompt = self._render([user], (), True)
        full = self._render([user, *template_messages(Conversation((message,)))], (), False)
        if not full.startswith(prompt):
            raise TemplateError("the chat template renders the generation prompt differently from a reply's start")
        end = full.find(self.end_of_turn, len(prompt))
        if end < 0:
            raise TemplateError(f"an assistant turn does not end with {self.end_of_turn!r}")
        return full[len(prompt) : end + len(self.end_of_turn)]

    def _probe_separator(self) -> str:
        call = ToolCall("call_1", "probe", {})
        body = self.assistant_body(Message("assistant", _PROBE_TEXT, (call,)))
        at, start = body.find(TOOL_OPEN), body.find(_PROBE_TEXT)
        if at < 0 or start < 0:
            return ""
        separator = body[start + len(_PROBE_TEXT) : at]
        return separator if not separator.strip() else ""

    def _probe_end_of_turn(self) -> str:
        user = {"role": "user", "content": _PROBE_TEXT}
        reply = {"role": "assistant", "content": _PROBE_TEXT + "!"}
        prompt = self._render([user], (), True)
        full = self._render([user, reply], (), False)
        if not full.startswith(prompt):
            raise TemplateError(
                "the chat template renders an assistant turn that does not start with its generation prompt"
            )
        rest = full[len(prompt) :]
        at = rest.find(_PROBE_TEXT + "!")
        if at < 0:
            raise TemplateError("the chat template drops an assistant turn's content")
        after = rest[at + len(_PROBE_TEXT) + 1 :]
        for token in self.added:
            if after.startswith(token):
                return token
        raise TemplateError(
            f"an assistant turn is followed by {after[:20]!r}, not by a special token the model could stop on"
        )


def check_template(renderer: TemplateRenderer, stop_texts: Sequence[str] = ()) -> None:
    """Probe the template: tools, tool calls and results, multi-turn; raise `TemplateError` on what fails.

    `stop_texts` are the texts of the engine's stop tokens: the template's end-of-turn must be one of them,
    or the model would never stop where the template ends a turn.
    """
    if stop_texts and renderer.end_of_turn not in stop_texts:
        raise TemplateError(
            f"the chat template ends a turn with {renderer.end_of_turn!r}, which is not a stop token of the model "
            f"({sorted(stop_texts)})"
        )
    tool = ToolSpec("read_file", "Read a file", {"type": "object", "properties": {"path": {"type": "string"}}})
    call = ToolCall("call_1", "read_file", {"path": "a.py"})
    probe = Conversation(
        (
            Message("system", "Be brief."),
            Message("user", "What is in a.py?"),
            Message("assistant", "Let me look.", (call,)),
            Message("tool", "print(1)"),
            Message("assistant", "It prints 1."),
            Message("user", "Thanks."),
        ),
        (tool,),
    )
    rendering = renderer.render(probe)
    text = "".join(u.text for u in rendering.units)
    if "read_file" not in text.split("What is in a.py?")[0]:
        raise TemplateError("the chat template does not list the tools offered")
    bodies = [u.text for u in rendering.units if u.kind == "body"]
    if len(bodies) != 2 or rendering.rewritten:
        raise TemplateError("the chat template does not render assistant turns as a prefix-stable history")
    body = bodies[0]
    if TOOL_OPEN not in body or TOOL_CLOSE not in body:
        raise TemplateError(f"the chat template does not write tool calls as {TOOL_OPEN}...{TOOL_CLOSE}")
    inner = body[body.index(TOOL_OPEN) + len(TOOL_OPEN) : body.index(TOOL_CLOSE)].strip()
    parsed = parse_tool_call(inner, lambda: "x")
    if parsed is None or parsed.name != "read_file" or parsed.arguments_object() != {"path": "a.py"}:
        raise TemplateError(f"a tool call renders as {inner!r}, which is not the JSON the proxy parses")
    if renderer.assistant_body(probe.messages[2]) != body:
        raise TemplateError("the chat template renders a reply differently depending on the turns around it")
    if "print(1)" not in text:
        raise TemplateError("the chat template drops tool results")



def _fast_renderer(chat_template: str | None) -> ChatRenderer | None:
    """The tiny template's fast Python renderer when ``chat_template`` is exactly that template."""
    from gyre.model.chat_template import CHAT_TEMPLATE

    return ChatMLRenderer() if chat_template == CHAT_TEMPLATE else None


def codec_renderer(codec: TokenCodec) -> ChatRenderer:
    """`renderer_for` the codec's tokenizer, without building one a `TokenCodec.tiny` left unbuilt (the tiny
    template's renderer needs none)."""
    fast = _fast_renderer(codec.chat_template)
    return fast if fast is not None else renderer_for(codec.tokenizer, codec.stop_texts)


def renderer_for(tokenizer: PreTrainedTokenizerBase, stop_texts: Sequence[str] = ()) -> ChatRenderer:
    """The tiny template's fast Python renderer when the tokenizer carries exactly that template, else the
    tokenizer's own jinja template, probed (`TemplateError` when it cannot be handled)."""
    if (fast := _fast_renderer(getattr(tokenizer, "chat_template", None))) is not None:
        return fast
    try:
        renderer = TemplateRenderer(tokenizer)
        check_template(renderer, stop_texts)
    except TemplateError as e:
        source = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise TemplateError(
            f"{source}: cannot use this checkpoint's chat template ({e}); the proxy refuses it rather than "
            "feed the model ids it was not trained on"
        ) from e
    return renderer
