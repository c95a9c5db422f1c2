"""OpenAI Responses API: the request model (HTTP boundary) and its translation into a `Conversation`.

Every request field and every tool and item kind has one rule (docs/proxy.md lists them): it is *rendered*
into the prompt, *answered* by the proxy without reaching the model (echoed, stored, or a no-op it can
honour exactly), or *refused* with a typed 400 naming the field. Unknown top-level fields are refused
(`extra="forbid"`): a field the proxy does not know may change what the model should see.

Tools: `function` tools are rendered as they are; a `namespace` group's tools are rendered under the stable
flat name `<namespace>.<name>`; a freeform `custom` tool (Codex's `apply_patch`) is rendered as a function
taking one string `input` (its grammar in the description); `local_shell` as a function taking an argv
`command`. `ToolPlan.routes` maps what the model calls back to the output item the harness expects.
Hosted tools (web search, file search, ...) run on OpenAI's side, which a training proxy has no equivalent
of: they are left out of the prompt and named in `model_call_started.dropped_tools`.

Consecutive assistant output items (`reasoning`, `message`, `function_call`, ...) form one assistant turn,
as the chat template renders it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gyre.proxy.conversation import Conversation, Message, ToolCall, ToolSpec, tojson
from gyre.proxy.errors import ApiError

_TEXT_PARTS = {"input_text", "output_text", "text", "refusal"}
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26", "file_search",
    "code_interpreter", "computer_use_preview", "computer_use", "image_generation", "mcp", "tool_search",
})
"""Tool kinds that OpenAI executes itself (`tool_search` included: its deferred tools live on OpenAI's side
or the harness's, in a shape no chat template renders): left out of the prompt, recorded as dropped."""
_NOTHING_TO_INCLUDE = frozenset({
    "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "message.input_image.image_url",
})
"""`include` values naming output the proxy never produces (no reasoning items, no hosted tool calls):
honoured exactly by including nothing."""
LOCAL_SHELL = "local_shell"
LOCAL_SHELL_SPEC = ToolSpec(
    LOCAL_SHELL,
    "Run a command on the local machine and return its output.",
    {
        "type": "object",
        "properties": {
            "command": {"type": "array", "items": {"type": "string"}, "description": "The command's argv."},
            "workdir": {"type": "string", "description": "The working directory."},
            "timeout_ms": {"type": "integer", "description": "A time limit in milliseconds."},
        },
        "required": ["command"],
    },
)
_TOOL_OUTPUTS = {"function_call_output", "custom_tool_call_output", "local_shell_call_output"}
_CALLS = {"function_call", "custom_tool_call", "local_shell_call"}


@dataclass(frozen=True, slots=True)
class ToolRoute:
    """What a rendered tool is to the harness: its kind, its own name and namespace."""

    kind: Literal["function", "custom", "local_shell"]
    name: str
    namespace: str | None = None


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """The tools a request offers, as the template lists them (`specs`), how a call of each maps back
    (`routes`, by flat name) and the hosted tools left out (`dropped`)."""

    specs: tuple[ToolSpec, ...] = ()
    routes: Mapping[str, ToolRoute] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()

    def route(self, name: str) -> ToolRoute:
        """How a call of `name` is answered; a name the request did not offer stays a function call."""
        return self.routes.get(name) or ToolRoute("function", name)


def flat_name(namespace: str | None, name: str) -> str:
    """The stable name a namespaced tool is rendered under (and the model calls)."""
    return f"{namespace}.{name}" if namespace else name


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(BaseModel):
    """A `POST /v1/responses` body. Each field's rule is in docs/proxy.md ("Responses: the rule per field")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    include: list[str] | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    metadata: dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """Refuse what the proxy cannot honour, naming the field."""
        if self.conversation is not None:
            raise ApiError(
                "invalid_request",
                "conversation objects are not supported: send the history in `input` or chain with "
                "previous_response_id",
                "conversation",
            )
        if self.background:
            raise ApiError("invalid_request", "background responses are not supported: the harness waits", "background")
        if self.prompt is not None:
            raise ApiError("invalid_request", "stored prompt templates are not supported: send the text", "prompt")
        if self.top_logprobs:
            raise ApiError("invalid_request", "top_logprobs are not returned by this proxy", "top_logprobs")
        fmt = (self.text.format if self.text is not None else None) or {}
        if fmt.get("type") not in (None, "text"):
            raise ApiError("invalid_request", "only text.format type 'text' is supported", "text.format.type")
        for i, value in enumerate(self.include or ()):
            if value not in _NOTHING_TO_INCLUDE:
                raise ApiError("invalid_request", f"include value {value!r} is not supported", f"include.{i}")
        choice = self.tool_choice
        if isinstance(choice, str) and choice not in ("auto", "none", "required"):
            raise ApiError("invalid_request", f"tool_choice {choice!r} is not supported", "tool_choice")
        if isinstance(choice, dict) and choice.get("type") not in ("function", "custom"):
            raise ApiError(
                "invalid_request",
                f"tool_choice of type {choice.get('type')!r} is not supported (only 'function' and 'custom')",
                "tool_choice.type",
            )

    @property
    def tools_enabled(self) -> bool:
        return self.tool_choice != "none"

    @property
    def stored(self) -> bool:
        """Whether this response is kept for a later `previous_response_id` (the API's default: yes)."""
        return self.store is not False

    def tool_plan(self) -> ToolPlan:
        """The tools to render, their routes back, and the hosted tools dropped (see the module docstring)."""
        specs: list[ToolSpec] = []
        routes: dict[str, ToolRoute] = {}
        dropped: list[str] = []

        def add(spec: ToolSpec, route: ToolRoute, where: str) -> None:
            if spec.name in routes:
                raise ApiError("invalid_request", f"two tools are named {spec.name!r}", where)
            specs.append(spec)
            routes[spec.name] = route

        for i, tool in enumerate(self.tools or ()):
            where = f"tools.{i}"
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind == "function":
                add(_function_spec(tool, where, None), ToolRoute("function", tool["name"]), f"{where}.name")
            elif kind == "custom":
                add(_custom_spec(tool, where), ToolRoute("custom", tool["name"]), f"{where}.name")
            elif kind == "local_shell":
                add(LOCAL_SHELL_SPEC, ToolRoute("local_shell", LOCAL_SHELL), f"{where}.type")
            elif kind == "namespace":
                namespace = _name(tool, where)
                members = tool.get("tools")
                if not isinstance(members, list):
                    raise ApiError("invalid_request", "a namespace tool needs a list of tools", f"{where}.tools")
                for j, member in enumerate(members):
                    inner = f"{where}.tools.{j}"
                    if not isinstance(member, dict) or member.get("type") != "function":
                        raise ApiError(
                            "invalid_request", "a namespace may only hold function tools", f"{inner}.type"
                        )
                    spec = _function_spec(member, inner, tool.get("description"))
                    spec = ToolSpec(flat_name(namespace, spec.name), spec.description, spec.parameters)
                    add(spec, ToolRoute("function", member["name"], namespace), f"{inner}.name")
            elif isinstance(kind, str) and kind in HOSTED_TOOLS:
                label = tool.get("server_label")
                dropped.append(f"{kind}:{label}" if isinstance(label, str) else kind)
            else:
                raise ApiError(
                    "invalid_request",
                    f"tools of type {kind!r} are not supported (function, custom, namespace, local_shell; hosted "
                    f"tools are left out: {', '.join(sorted(HOSTED_TOOLS))})",
                    f"{where}.type",
                )
        return ToolPlan(tuple(specs), routes, tuple(dropped))

    def conversation_of(self, plan: ToolPlan, entries: Sequence[tuple[str, Any]] | None = None) -> Conversation:
        """The conversation: `instructions` as the system prompt, then the items of `entries` ((where, item):
        a stored response's items and `input`, references resolved by `ResponseStore.expand`; default: `input`)."""
        messages: list[Message] = []
        if self.instructions is not None:
            messages.append(Message("system", self.instructions))
        turn: _Turn | None = None
        if entries is None:
            entries = [(f"input.{i}", item) for i, item in enumerate(self.input_items())]
        for where, item in entries:
            if not isinstance(item, dict):
                raise ApiError("invalid_request", "each input item must be an object", where)
            kind = item.get("type", "message")
            if kind in _CALLS or kind == "reasoning" or (kind == "message" and item.get("role") == "assistant"):
                if turn is not None and turn.calls and kind not in _CALLS:
                    messages.append(turn.message())  # text or reasoning after a call starts a new turn
                    turn = None
                turn = turn or _Turn()
                if kind == "message":
                    turn.texts.append(_text(item.get("content"), where))
                elif kind == "reasoning":
                    turn.reasoning += _reasoning(item, where)
                else:
                    turn.calls.append(_call(kind, item, where))
                continue
            if turn is not None:
                messages.append(turn.message())
                turn = None
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer"):
                    raise ApiError("invalid_request", f"unknown message role {role!r}", f"{where}.role")
                messages.append(Message("user" if role == "user" else "system", _text(item.get("content"), where)))
            elif kind in _TOOL_OUTPUTS:
                output = item.get("output")
                messages.append(Message("tool", output if isinstance(output, str) else _text(output, where, "output")))
            else:
                raise ApiError(
                    "invalid_request",
                    f"input items of type {kind!r} are not supported (the proxy offers no tool that makes them)",
                    f"{where}.type",
                )
        if turn is not None:
            messages.append(turn.message())
        return Conversation(tuple(messages), plan.specs)

    def input_items(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input


class _Turn:
    def __init__(self) -> None:
        self.texts: list[str] = []
        self.calls: list[ToolCall] = []
        self.reasoning: list[str] = []

    def message(self) -> Message:
        return Message("assistant", "".join(self.texts), tuple(self.calls), "\n".join(self.reasoning) or None)


def _name(tool: dict[str, Any], where: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError("invalid_request", f"a {tool.get('type')} tool needs a non-empty name", f"{where}.name")
    return name


def _description(value: object, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ApiError("invalid_request", "a tool description must be a string", f"{where}.description")
    return value


def _function_spec(tool: dict[str, Any], where: str, group: object) -> ToolSpec:
    name = _name(tool, where)
    parameters = tool.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ApiError("invalid_request", "function parameters must be a JSON schema object", f"{where}.parameters")
    description = _description(tool.get("description"), where)
    group_text = _description(group, where.rsplit(".tools.", 1)[0])
    if group_text:  # the namespace's own description, kept with each of its tools
        description = f"{group_text}\n{description}" if description else group_text
    return ToolSpec(name, description, parameters)


def _custom_spec(tool: dict[str, Any], where: str) -> ToolSpec:
    """A freeform tool as a function of one string, `input`; a grammar format is shown in its description."""
    name = _name(tool, where)
    fmt = tool.get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
        raise ApiError("invalid_request", "a custom tool's format must be 'text' or 'grammar'", f"{where}.format")
    about = "Free-form text."
    if fmt["type"] == "grammar":
        definition = fmt.get("definition")
        if not isinstance(definition, str):
            raise ApiError("invalid_request", "a grammar format needs a definition", f"{where}.format.definition")
        about = f"Text in this {fmt.get('syntax', 'lark')} grammar:\n{definition}"
    parameters = {
        "type": "object",
        "properties": {"input": {"type": "string", "description": about}},
        "required": ["input"],
    }
    return ToolSpec(name, _description(tool.get("description"), where), parameters)


def _call(kind: str, item: dict[str, Any], where: str) -> ToolCall:
    """An echoed call item as the tool call the template renders (the shape the model writes it in)."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise ApiError("invalid_request", f"a {kind} item needs a string call_id", f"{where}.call_id")
    if kind == "local_shell_call":
        action = item.get("action")
        if not isinstance(action, dict) or not isinstance(action.get("command"), list):
            raise ApiError("invalid_request", "a local_shell_call needs an exec action", f"{where}.action")
        return ToolCall(call_id, LOCAL_SHELL, shell_arguments(action))
    field_name = "input" if kind == "custom_tool_call" else "arguments"
    for key in ("name", field_name):
        if not isinstance(item.get(key), str):
            raise ApiError("invalid_request", f"a {kind} item needs a string {key}", f"{where}.{key}")
    if kind == "custom_tool_call":
        return ToolCall(call_id, item["name"], {"input": item["input"]})
    namespace = item.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise ApiError("invalid_request", "a function_call namespace must be a string", f"{where}.namespace")
    return ToolCall(call_id, flat_name(namespace, item["name"]), item["arguments"])


def shell_action(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """A `local_shell` call's arguments as the `exec` action of a `local_shell_call` item. A command the
    model wrote as one string runs through `bash -lc` (echoed back as that argv: recorded as drift)."""
    command = arguments.get("command")
    if isinstance(command, str):
        command = ["bash", "-lc", command]
    elif not isinstance(command, list) or not all(isinstance(part, str) for part in command):
        command = ["bash", "-lc", tojson(command)]
    workdir = arguments.get("workdir")
    timeout = arguments.get("timeout_ms")
    return {
        "type": "exec",
        "command": command,
        "working_directory": workdir if isinstance(workdir, str) else None,
        "timeout_ms": timeout if isinstance(timeout, int) and not isinstance(timeout, bool) else None,
        "env": {},
        "user": None,
    }


def shell_arguments(action: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `shell_action`: the arguments a model writes for that action."""
    arguments: dict[str, Any] = {"command": action["command"]}
    if action.get("working_directory"):
        arguments["workdir"] = action["working_directory"]
    if action.get("timeout_ms") is not None:
        arguments["timeout_ms"] = action["timeout_ms"]
    return arguments


def custom_input(arguments: Mapping[str, Any]) -> str:
    """A custom tool call's `input`: the string the model passed, else (another shape) its arguments' JSON."""
    value = arguments.get("input")
    if isinstance(value, str) and set(arguments) == {"input"}:
        return value
    return tojson(dict(arguments))


def _reasoning(item: dict[str, Any], where: str) -> list[str]:
    """A reasoning item's readable text (its `content`, else its summary), rendered as the turn's reasoning.
    `encrypted_content` is another model's opaque state: nothing this model could read is in it."""
    texts = []
    for key, part_kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise ApiError("invalid_request", f"reasoning {key} must be a list of parts", f"{where}.{key}")
        for i, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != part_kind or not isinstance(part.get("text"), str):
                raise ApiError("invalid_request", f"reasoning {key} parts must be {part_kind}", f"{where}.{key}.{i}")
            texts.append(part["text"])
        if texts:
            return texts
    return texts


def _text(content: object, where: str, key: str = "content") -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError("invalid_request", f"{key} must be a string or a list of parts", f"{where}.{key}")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise ApiError(
                "invalid_request",
                f"{kind} content is not supported: this model reads text only",
                f"{where}.{key}.{i}.type",
            )
        text = part.get("refusal" if kind == "refusal" else "text")
        if text is not None and not isinstance(text, str):
            raise ApiError("invalid_request", "a text part's text must be a string", f"{where}.{key}.{i}")
        parts.append(text or "")
    return "".join(parts)
