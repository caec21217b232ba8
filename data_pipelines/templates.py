"""The one call of a policy's chat template (prompts, SFT conversations, tool observations): :func:`render`.

Given tool schemas, a template that lists tools itself (Qwen2.5, Qwen3, the tiny models) gets them as its
``tools``; one that ignores them (Qwen2-VL, Qwen2.5-VL) gets Qwen's documented tool text appended to the system
turn instead (:func:`tools_system_text`), so every model is told its tools the same way. A text-only tokenizer's
template gets string contents (:func:`~data_pipelines.formatting.text_only_messages`).
"""

from __future__ import annotations

import json
from typing import Any

from data_pipelines.formatting import text_only_messages

DEFAULT_SYSTEM = "You are a helpful assistant."
_PROBE_TOOL = {"type": "function", "function": {"name": "vlrft_template_probe", "description": "", "parameters": {}}}


def tools_system_text(system: str | None, tools: list[dict[str, Any]]) -> str:
    """Qwen's system text for tools (as Qwen2.5's template writes it): the system prompt, then the schemas in
    ``<tools></tools>`` and how to call them."""
    listed = "".join("\n" + json.dumps(t) for t in tools)
    return (
        f"{system or DEFAULT_SYSTEM}\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
        'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def lists_tools(processor: Any) -> bool:
    """Whether the processor's chat template writes the ``tools`` it is given (cached on the processor)."""
    known = getattr(processor, "_vlrft_lists_tools", None)
    if known is None:
        text = processor.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True
        )
        known = _PROBE_TOOL["function"]["name"] in text
        processor._vlrft_lists_tools = known
    return known


def _system_with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rest = messages
    system = None
    if messages and messages[0]["role"] == "system":
        content = messages[0]["content"]
        system = content if isinstance(content, str) else "".join(c.get("text", "") for c in content)
        rest = messages[1:]
    return [{"role": "system", "content": [{"type": "text", "text": tools_system_text(system, tools)}]}, *rest]


def render(
    processor: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool,
    tokenize: bool,
) -> Any:
    """The chat template applied to ``messages`` (with ``tools`` listed in the system turn): the text, or with
    ``tokenize`` the processor's tensors (ids, images, ``mm_token_type_ids``)."""
    if getattr(processor, "image_processor", None) is None:
        messages = text_only_messages(messages)
    if tools and not lists_tools(processor):
        messages, tools = _system_with_tools(messages, tools), None
    kwargs: dict[str, Any] = {"tools": tools} if tools else {}
    if tokenize:
        kwargs.update(return_dict=True, return_tensors="pt")
    return processor.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs
    )
