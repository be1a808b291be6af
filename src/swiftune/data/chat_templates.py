"""Chat templates with ``{% generation %}`` markers for families whose own template has none and
is not prefix-stable, so that ``assistant_only_loss`` can find the assistant turns.

``assistant_only_loss`` needs to know which tokens each assistant turn produced. Templates with
``{% generation %}`` markers say so (transformers' ``return_assistant_tokens_mask``); for the others
swiftune renders growing prefixes of the conversation (:mod:`swiftune.data.formatting`), which only
works when rendering more messages appends to the text. Qwen3's template is not like that: an
assistant turn after the last user query is rendered with its ``<think>`` block, the same turn
before a later query without it, so the prefix renderings disagree with the whole conversation.

For such a template swiftune carries its own equivalent with markers:

* :data:`QWEN3_TEMPLATE`: renders exactly the text Qwen3's (hybrid thinking) template renders,
  for every message it supports (system, user, assistant with ``reasoning_content`` or inline
  ``<think>``, ``tool_calls``, ``tool`` responses, ``tools``, ``add_generation_prompt``,
  ``enable_thinking``), with each assistant turn's output (after ``<|im_start|>assistant\\n``,
  through ``<|im_end|>\\n``) inside ``{% generation %}``.

:func:`marked_template_for` decides when to use it: the tokenizer's template must have Qwen3's
features and render a set of probe conversations to the same strings as :data:`QWEN3_TEMPLATE`
(a template that looks like Qwen3's but renders anything differently is not replaced). The caller
also checks every row: the marked template's tokens must equal the tokenizer's own template's.
Unlike TRL's training templates, the rendered text is never changed (TRL's Qwen3 training
template adds a ``<think>`` block to every assistant turn).
"""

from __future__ import annotations

from typing import Any

# The tokenizer's own template renders; this one renders the same text and marks the assistant output.
QWEN3_TEMPLATE = r"""
{#- swiftune's Qwen3 template: the text of Qwen3's own template, assistant output in generation blocks -#}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' }}
    {{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": ' }}
    {{- '<args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{#- the last real user query: a string content that is not a wrapped tool response -#}
{%- set query = namespace(index=messages|length - 1, found=false) %}
{%- for i in range(messages|length - 1, -1, -1) %}
    {%- set m = messages[i] %}
    {%- if not query.found and m.role == 'user' and m.content is string
          and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) %}
        {%- set query.index = i %}
        {%- set query.found = true %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- set text = m.content if m.content is string else '' %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + m.role + '\n' + text + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set turn = namespace(thought='', answer=text) %}
        {%- if m.reasoning_content is string %}
            {%- set turn.thought = m.reasoning_content %}
        {%- elif '</think>' in text %}
            {%- set turn.thought = text.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set turn.answer = text.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>' + m.role + '\n' }}
        {%- generation %}
        {#- the thinking is shown after the last query: always on the final turn, else where there is some -#}
        {%- if loop.index0 > query.index and (loop.last or turn.thought) %}
            {{- '<think>\n' + turn.thought.strip('\n') + '\n</think>\n\n' + turn.answer.lstrip('\n') }}
        {%- else %}
            {{- turn.answer }}
        {%- endif %}
        {%- for call in m.tool_calls or [] %}
            {%- if not loop.first or turn.answer %}
                {{- '\n' }}
            {%- endif %}
            {%- set fn = call.function if call.function else call %}
            {{- '<tool_call>\n{"name": "' }}{{- fn.name }}{{- '", "arguments": ' }}
            {%- if fn.arguments is string %}
                {{- fn.arguments }}
            {%- else %}
                {{- fn.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
        {%- endgeneration %}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + text + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
""".strip()

# What Qwen3's hybrid-thinking template contains (a cheap first test before the probe renderings).
_QWEN3_FEATURES = ("<|im_start|>", "<think>", "</think>", "reasoning_content", "enable_thinking",
                   "<tool_response>", "last_query_index")

_TOOL = {"type": "function", "function": {"name": "lookup", "description": "Find a word.",
                                          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
_CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"q": "river"}}}

# Conversations whose renderings must agree (with and without tools, generation prompt, thinking).
PROBES: tuple[tuple[list[dict[str, Any]], dict[str, Any]], ...] = (
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], {}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "<think>\nsay hi\n</think>\n\nHello"}, {"role": "user", "content": "Again"},
      {"role": "assistant", "content": "Hi", "reasoning_content": "again"}], {}),
    ([{"role": "user", "content": "Look up river"},
      {"role": "assistant", "content": "", "tool_calls": [_CALL]},
      {"role": "tool", "content": "a stream"}, {"role": "tool", "content": "water"},
      {"role": "assistant", "content": "A stream of water."}], {"tools": [_TOOL]}),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
     {"add_generation_prompt": True, "enable_thinking": False}),
)


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else ""


def looks_like_qwen3(template: str) -> bool:
    """Whether ``template`` has the features of Qwen3's hybrid-thinking chat template."""
    return all(feature in template for feature in _QWEN3_FEATURES)


def renders_like(tokenizer: Any, template: str, other: str) -> bool:
    """Whether ``template`` and ``other`` render every probe conversation to the same string."""
    for messages, kwargs in PROBES:
        try:
            a = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template, **kwargs)
            b = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=other, **kwargs)
        except Exception:  # a template that cannot render a probe is not the one we replace
            return False
        if a != b:
            return False
    return True


def marked_template_for(tokenizer: Any) -> str | None:
    """swiftune's marked equivalent of the tokenizer's chat template, or ``None`` when there is none.

    Qwen3's template (recognised by its features and by rendering :data:`PROBES` exactly as
    :data:`QWEN3_TEMPLATE` does) gets :data:`QWEN3_TEMPLATE`; a template that already has
    ``{% generation %}`` markers, or any other template, gets ``None``.
    """
    template = _template_text(tokenizer)
    if not template or "endgeneration" in template or not looks_like_qwen3(template):
        return None
    return QWEN3_TEMPLATE if renders_like(tokenizer, template, QWEN3_TEMPLATE) else None
