"""The chat template (HF jinja) of the tiny tokenizer, in Qwen2.5's ChatML dialect.

Design rule: an assistant turn renders as `content` immediately followed by each tool call as
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, then `<|im_end|>`. There is no separator that
the model would not have produced itself, so a conversation re-rendered with the model's own reply is a
token-exact extension of the prompt plus the sampled output (what the proxy's TITO path relies on).

Tool results render as Qwen does: consecutive `tool` messages share one user turn, each inside
`<tool_response>...</tool_response>`. `arguments` may be a mapping (rendered with `tojson`) or an
already-serialised JSON string (OpenAI style), which is copied verbatim.
"""

CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is mapping -%}{{- content.text if content.text is defined else '' -}}"
    "{%- elif content is iterable -%}"
    "{%- for part in content -%}"
    "{%- if part is string -%}{{- part -}}"
    "{%- elif part is mapping and part.type == 'text' -%}{{- part.text -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- elif content is not none -%}{{- content -}}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set first_is_system = messages and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if first_is_system -%}{{- render_content(messages[0].content) + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are inside <tools></tools>:"
    "\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    '{{- \'\\n</tools>\\n\\nTo call a function, write <tool_call>{"name": <function-name>, '
    '"arguments": <args-json-object>}</tool_call>.<|im_end|>\\n\' -}}'
    "{%- elif first_is_system -%}"
    "{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}"
    "{%- if not loop.first -%}"
    "{{- '<|im_start|>system\\n' + render_content(message.content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- elif message.role == 'user' -%}"
    "{{- '<|im_start|>user\\n' + render_content(message.content) + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message.reasoning_content -%}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- render_content(message.content) -}}"
    "{%- for call in (message.tool_calls or []) -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{{- '<tool_call>{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}"
    "{%- elif fn.arguments is defined and fn.arguments is not none -%}{{- fn.arguments | tojson -}}"
    "{%- else -%}{{- '{}' -}}"
    "{%- endif -%}"
    "{{- '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- raise_exception('unknown message role: ' + (message.role | string)) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
