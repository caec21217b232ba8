"""What a tool is, what it returns, and how the policy calls one (Qwen's tool-call format).

A :class:`Tool` is a name, a JSON schema for its arguments (the OpenAI/Qwen ``{"type": "function", "function":
{...}}`` form the chat template lists in the system turn) and a function returning a :class:`ToolResult` (text
and/or images). The policy calls tools in Qwen's documented format, one JSON object per call::

    <tool_call>
    {"name": "zoom", "arguments": {"region": "top_left"}}
    </tool_call>

:func:`parse_tool_calls` reads every call of an assistant turn, never evaluating anything; a call that cannot be
read is a :class:`CallError` (the model sees it as an error observation, and it is counted), as are arguments
that break the tool's schema (:func:`check_arguments`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
MAX_CALL_CHARS = 4096  # a call's JSON beyond this is refused unread
ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "image_limit")


@dataclass
class ToolResult:
    """What a tool returns: text, images (PIL), or both."""

    text: str = ""
    images: list[Any] = field(default_factory=list)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class CallError:
    """A call that cannot be run: ``kind`` is one of :data:`ERROR_KINDS`, ``message`` what the model is told."""

    kind: str
    message: str
    name: str = ""


@dataclass
class Tool:
    """A callable tool: ``fn(context, **arguments) -> ToolResult`` (built-ins) behind its schema."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments (type object)
    fn: Callable[..., ToolResult] | None = None
    spec: str = ""  # path/to/file.py:name for a user's tool

    @property
    def schema(self) -> dict[str, Any]:
        """The function schema the chat template lists (Qwen / OpenAI form)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def tool_message(result: ToolResult | CallError) -> dict[str, Any]:
    """A call's result as the chat template's tool turn: its text (a failed call: ``error: ...``) and its images
    as image parts."""
    if isinstance(result, CallError):
        return {"role": "tool", "content": [{"type": "text", "text": f"error: {result.message}"}]}
    text = [{"type": "text", "text": result.text}] if result.text or not result.images else []
    return {"role": "tool", "content": text + [{"type": "image", "image": im} for im in result.images]}


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A call as the policy writes it (demonstrations for SFT)."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_CLOSE}"


def parse_tool_calls(text: str) -> list[ToolCall | CallError]:
    """Every ``<tool_call>...</tool_call>`` of ``text`` in order, parsed as JSON (never evaluated); an opening tag
    without its closing tag is one malformed call. ``[]``: the turn calls nothing (it answers)."""
    out: list[ToolCall | CallError] = []
    for m in _CALL.finditer(text):
        out.append(_one_call(m.group(1)))
    if text.count(CALL_OPEN) > len(out):
        out.append(CallError("malformed", f"a {CALL_OPEN} without its {CALL_CLOSE}"))
    return out


def _one_call(body: str) -> ToolCall | CallError:
    body = body.strip()
    if len(body) > MAX_CALL_CHARS:
        return CallError("malformed", f"a tool call of {len(body)} characters (at most {MAX_CALL_CHARS})")
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return CallError("malformed", f"the tool call is not JSON ({str(exc)[:80]})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return CallError("malformed", 'want {"name": <tool name>, "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return CallError("malformed", "the arguments are not a JSON object", obj["name"])
    if not isinstance(args, dict):
        return CallError("malformed", "the arguments are not a JSON object", obj["name"])
    return ToolCall(obj["name"], args)


_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def check_arguments(parameters: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """Why ``arguments`` break the schema ``parameters`` (the subset tools use: required, properties with type,
    enum, minimum/maximum, items, minItems/maxItems; no unknown keys), or None when they fit."""
    props = parameters.get("properties", {})
    for key in parameters.get("required", []):
        if key not in arguments:
            return f"missing argument {key!r}"
    for key, value in arguments.items():
        if key not in props:
            return f"unknown argument {key!r} (known: {', '.join(props) or 'none'})"
        why = _check_value(props[key], value, key)
        if why:
            return why
    return None


def _check_value(schema: dict[str, Any], value: Any, where: str) -> str | None:
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]  # ["integer", "null"]: either
        types = tuple(t for k in kinds for t in _TYPES.get(k, (object,)))
        if isinstance(value, bool) and "boolean" not in kinds or not isinstance(value, types):
            return f"{where} must be {' or '.join(kinds)}, got {json.dumps(value)[:40]}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where}={json.dumps(value)[:40]} is not one of {', '.join(map(str, schema['enum']))}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            return f"{where}={value} is below {schema['minimum']}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{where}={value} is above {schema['maximum']}"
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            return f"{where} has {len(value)} items"
        for i, item in enumerate(value):
            why = _check_value(schema.get("items", {}), item, f"{where}[{i}]")
            if why:
                return why
    return None


def schema_problem(parameters: Any) -> str | None:
    """What makes ``parameters`` unusable as a tool's argument schema (the subset :func:`check_arguments` reads: an
    object, ``properties`` a dict of schemas, ``required`` a list of their names), or None when it is usable."""
    if not isinstance(parameters, dict):
        return f"its parameters are a {type(parameters).__name__}; want a JSON schema (a dict) of type object"
    if parameters.get("type", "object") != "object":
        return f"its parameters are of type {parameters.get('type')!r}; want type object"
    props = parameters.get("properties", {})
    if not isinstance(props, dict):
        return f"'properties' is a {type(props).__name__}; want a dict of argument name -> schema"
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        return f"'required' is {json.dumps(required, default=repr)[:40]}; want a list of argument names"
    missing = [k for k in required if k not in props]
    if missing:
        return f"'required' names {missing[0]!r}, which is not in 'properties' ({', '.join(props) or 'none'})"
    for key, schema in props.items():
        why = _value_schema_problem(schema, f"properties.{key}")
        if why:
            return why
    return None


def _value_schema_problem(schema: Any, where: str) -> str | None:
    if not isinstance(schema, dict):
        return f"'{where}' is a {type(schema).__name__}; want a dict (a JSON schema)"
    kinds = schema.get("type", [])
    if not all(isinstance(k, str) and k in _TYPES for k in (kinds if isinstance(kinds, list) else [kinds])):
        return f"'{where}.type' is {json.dumps(kinds, default=repr)[:40]}; want one of {', '.join(_TYPES)}"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"'{where}.enum' is a {type(schema['enum']).__name__}; want a list"
    for bound in ("minimum", "maximum", "minItems", "maxItems"):
        if bound in schema and (isinstance(schema[bound], bool) or not isinstance(schema[bound], (int, float))):
            return f"'{where}.{bound}' is {json.dumps(schema[bound], default=repr)[:40]}; want a number"
    return _value_schema_problem(schema["items"], f"{where}.items") if "items" in schema else None
