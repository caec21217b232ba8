"""The tools of a run (``tools:`` in a config): loading them, checking them before the run, and running one call
under a time limit.

``tools.names`` lists built-in tools (``zoom``, ``crop``, ``rotate``, ``calculator``: ``vlrft.tools.builtin``)
and the user's own, ``path/to/file.py:function`` or ``package.module:function`` (the mechanism of user reward
functions, ``vlrft.user_code``). A user tool is called with its arguments as keywords, plus ``images`` (the
trajectory's images so far, full resolution, PIL) when its signature has that parameter; it returns a string, a
PIL image, a list of those, or ``{"text": ..., "images": [...]}``. Its schema is its ``schema`` attribute (a JSON
schema of the arguments, or the whole ``{"type": "function", ...}`` form), else the one transformers derives
from its type hints and docstring (``get_json_schema``). User tools run in worker processes (``isolation:
process``, killed past ``timeout_s``) or in this process (``inline``: a call past its time limit is abandoned,
not stopped).
"""

from __future__ import annotations

import base64
import inspect
import pickle
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from PIL import Image
from transformers.utils import get_json_schema

from data_pipelines.images import DEFAULT_MAX_IMAGE_PIXELS
from vlrft.config import ConfigError, option
from vlrft.tools.base import CallError, Tool, ToolCall, ToolResult, check_arguments, schema_problem
from vlrft.tools.builtin import BUILTIN_TOOLS, ToolContext, ToolFailure
from vlrft.user_code import is_spec, load_callable, raised_at, source_file, where
from vlrft.workers import WorkerPool

CONTEXT_PARAMETERS = ("images",)  # what a user tool may ask for besides its arguments
# a tool's text is cut to this many characters per token of tools.max_tokens before it is tokenized: more than any
# text that fits the budget needs (a few characters per token), so a tool answering megabytes costs nothing
CHARS_PER_TOKEN = 32


@dataclass
class ToolsConfig:
    """Multi-turn rollouts with tools (docs/tools.md). Empty ``names``: one response per prompt, no tools."""

    names: list = option(
        [], "tools the policy may call: zoom, crop, rotate, calculator, or path/to/file.py:function (yours)"
    )
    max_turns: int = option(4, "assistant turns per trajectory at most (a call in the last one goes unanswered)", ge=1)
    max_tokens: int = option(
        1024, "token budget of a whole trajectory after the prompt (sampled tokens and observations)", ge=1
    )
    timeout_s: float = option(10.0, "time limit of one tool call", gt=0)
    max_images: int = option(4, "images the tools may return in one trajectory", ge=0)
    max_calls_per_turn: int = option(4, "tool calls run per assistant turn (more are answered with an error)", ge=1)
    isolation: str = option(
        "process", "your tools run in worker processes (killed past timeout_s) or inline", choices=("process", "inline")
    )
    num_workers: int = option(2, "worker processes for your tools (isolation: process)", ge=1)
    memory_limit_mb: int = option(4096, "address-space limit of a tool's worker process (0: none)", ge=0)
    call_reward: float = option(
        0.0, "added to a trajectory's reward per call that ran (negative: a penalty)", finite=True
    )
    error_reward: float = option(
        0.0, "added per call that failed (malformed, unknown tool, bad arguments, ...)", finite=True
    )
    eval_withheld: bool = option(
        True,
        "held-out evaluation also with the tools' answers withheld (blank images, no text: eval/withheld/*): what "
        "the accuracy owes to what the tools return",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.names)


def _user_schema(fn: Any, spec: str, key: str) -> tuple[str, str, dict]:
    given = getattr(fn, "schema", None)
    at = f"{key}={spec}: {where(fn)}"
    if given is None:
        try:
            given = get_json_schema(fn)
        except Exception as exc:  # noqa: BLE001 - transformers' message says what the docstring lacks
            raise ConfigError(
                f"{at}: no schema: give the function a `schema` attribute (a JSON schema "
                f"of its arguments) or type hints and a Google-style docstring ({exc})"
            ) from exc
        params = given["function"]["parameters"]
        for name in CONTEXT_PARAMETERS:
            params.get("properties", {}).pop(name, None)
            if name in params.get("required", []):
                params["required"].remove(name)
    if not isinstance(given, dict):
        raise ConfigError(
            f"{at}: its schema is a {type(given).__name__}; want a dict: a JSON schema of its arguments, or "
            '{"type": "function", "function": {"name": ..., "parameters": ...}}'
        )
    if given.get("type") == "function":
        function = given.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ConfigError(
                f'{at}: its schema {{"type": "function", ...}} names no tool: want "function": {{"name": ...}}'
            )
        name, description, params = function["name"], function.get("description", ""), function.get("parameters", {})
    else:
        name, description, params = fn.__name__, (inspect.getdoc(fn) or "").split("\n")[0], given
    why = schema_problem(params) or (None if isinstance(description, str) else "its description is not text")
    if why:
        raise ConfigError(f"{at}: tool {name!r}: {why}")
    return name, description, params


def load_tools(cfg: ToolsConfig, key: str = "tools.names") -> list[Tool]:
    """The configured tools, checked: known built-ins, user functions that import, each with a schema; no two of
    one name. Raises :class:`~vlrft.config.ConfigError` naming the entry."""
    tools: list[Tool] = []
    for i, name in enumerate(cfg.names):
        where_key = f"{key}[{i}]"
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where_key}={name!r}: want a tool name or path/to/file.py:function")
        if is_spec(name):
            fn = load_callable(name, where_key)
            tool_name, description, params = _user_schema(fn, name, where_key)
            tools.append(Tool(tool_name, description, params, fn, spec=name))
        elif name in BUILTIN_TOOLS:
            tools.append(BUILTIN_TOOLS[name])
        else:
            raise ConfigError(
                f"{where_key}={name}: unknown tool; built in: {', '.join(BUILTIN_TOOLS)}, or path/to/file.py:function"
            )
    names = [t.name for t in tools]
    for n in names:
        if names.count(n) > 1:
            raise ConfigError(f"{key}: two tools named {n!r}")
    return tools


def check_tools(cfg: ToolsConfig, key: str = "tools") -> None:
    """Preflight: the tools load and their settings agree."""
    load_tools(cfg, f"{key}.names")


class ToolReturnError(TypeError):
    """A user tool returned something that is not a tool's answer; the message names the tool's file and line."""


def user_result(raw: Any) -> ToolResult:
    """A user tool's return value as a :class:`ToolResult` (raises ``TypeError`` naming what it got, ``ValueError``
    for an image over the record images' cap ``DEFAULT_MAX_IMAGE_PIXELS``, checked before it is converted)."""
    if isinstance(raw, ToolResult):
        parts = [raw.text, *raw.images]
    elif isinstance(raw, dict) and set(raw) <= {"text", "images"}:
        parts = [raw.get("text") or ""] + list(raw.get("images") or [])
    else:
        parts = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    out = ToolResult()
    for part in parts:
        if isinstance(part, str):
            out.text += part
        elif isinstance(part, Image.Image):
            w, h = part.size
            if w * h > DEFAULT_MAX_IMAGE_PIXELS:
                raise ValueError(
                    f"returned a {w}x{h} image ({w * h} pixels), more than the {DEFAULT_MAX_IMAGE_PIXELS} a record "
                    "image may have"
                )
            out.images.append(part.convert("RGB"))
        elif isinstance(part, (int, float)) and not isinstance(part, bool):
            out.text += str(part)
        else:
            raise TypeError(
                f"returned {type(part).__name__}; want text, a PIL image, a list of them or {{text, images}}"
            )
    return out


def cut_text(result: ToolResult, max_chars: int) -> ToolResult:
    """``result`` with its text cut to ``max_chars`` characters (a note says how many more there were)."""
    if len(result.text) <= max_chars:
        return result
    more = len(result.text) - max_chars
    return ToolResult(f"{result.text[:max_chars]}\n[{more} more characters cut]", result.images)


def call_user_tool(fn: Any, arguments: dict[str, Any], images: list[Image.Image], max_chars: int) -> ToolResult:
    """Call a user tool (in whichever process runs it): its answer checked (a wrong one is a
    :class:`ToolReturnError` naming the tool's file and line) and its text cut to ``max_chars``."""
    extra = {"images": images} if "images" in inspect.signature(fn).parameters else {}
    raw = fn(**arguments, **extra)
    try:
        return cut_text(user_result(raw), max_chars)
    except (TypeError, ValueError) as exc:
        raise ToolReturnError(f"{where(fn)} ({getattr(fn, '__name__', fn)}): {exc}") from None


def failure(exc: BaseException, fn: Any = None) -> str:
    """A user tool's failure as the model is told it: ``file:line: Type: message`` at the tool's own line in
    ``fn``'s file (:func:`~vlrft.user_code.raised_at`), or what it returned (:class:`ToolReturnError`, located
    at the tool)."""
    if isinstance(exc, ToolReturnError):
        return str(exc)
    at = raised_at(exc, source_file(fn))
    if isinstance(exc, SystemExit):
        return f"{at}SystemExit({exc.code!r}): a tool may not end the run"
    return f"{at}{type(exc).__name__}: {str(exc)[:200]}"


class ToolBox:
    """The run's tools, ready to be called: ``run(call, context) -> ToolResult | CallError``."""

    def __init__(self, cfg: ToolsConfig, bounds: dict[str, int] | None = None):
        self.cfg, self.bounds = cfg, dict(bounds or {})
        self.tools = {t.name: t for t in load_tools(cfg)}
        self.schemas = [t.schema for t in self.tools.values()]
        self._threads = ThreadPoolExecutor(max_workers=8, thread_name_prefix="tool")  # in-process calls
        self._batch = ThreadPoolExecutor(max_workers=8, thread_name_prefix="tool-batch")  # a batch's calls at once
        self.workers = None
        self.max_chars = cfg.max_tokens * CHARS_PER_TOKEN
        if cfg.isolation == "process" and any(t.spec for t in self.tools.values()):
            memory = {"VLRFT_WORKER_MEMORY_MB": str(cfg.memory_limit_mb)}
            self.workers = WorkerPool("vlrft.tools.worker", env=memory, log="tools")
            self.workers.prestart(cfg.num_workers)

    def run(self, call: ToolCall, images: list[Any]) -> ToolResult | CallError:
        """Run one parsed call on a trajectory's images (``ImageView`` list); every failure is a ``CallError``."""
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return CallError("unknown_tool", f"unknown tool {call.name!r} (tools: {known})", call.name)
        why = check_arguments(tool.parameters, call.arguments)
        if why:
            return CallError("bad_arguments", f"{call.name}: {why}", call.name)
        if tool.spec and self.workers is not None:
            return self._in_worker(tool, call, images)
        if tool.spec:
            originals = [v.original for v in images]
            job = lambda: call_user_tool(tool.fn, call.arguments, originals, self.max_chars)  # noqa: E731
        else:
            job = lambda: cut_text(tool.fn(ToolContext(images, self.bounds), **call.arguments), self.max_chars)  # noqa: E731
        future = self._threads.submit(job)
        try:
            return future.result(timeout=self.cfg.timeout_s)
        except FutureTimeout:
            return CallError("timeout", f"{call.name} took longer than {self.cfg.timeout_s:g} s", call.name)
        except ToolFailure as exc:
            return CallError("bad_arguments", f"{call.name}: {exc}", call.name)
        except (Exception, SystemExit, KeyboardInterrupt) as exc:  # noqa: BLE001 - the model's observation, counted
            return CallError("raised", f"{call.name} failed: {failure(exc, tool.fn)}", call.name)

    def run_many(self, jobs: list[tuple[ToolCall, list[Any]]]) -> list[ToolResult | CallError]:
        """:meth:`run` of each (call, images), concurrently: a slow call does not hold up the others."""
        return list(self._batch.map(lambda job: self.run(*job), jobs))

    def _in_worker(self, tool: Tool, call: ToolCall, images: list[Any]) -> ToolResult | CallError:
        request = {
            "spec": tool.spec,
            "arguments": call.arguments,
            "images": [v.original for v in images],
            "max_chars": self.max_chars,
        }
        line, why = self.workers.call(base64.b64encode(pickle.dumps(request)), self.cfg.timeout_s)
        if line is None and why == "timeout":
            return CallError("timeout", f"{call.name} took longer than {self.cfg.timeout_s:g} s", call.name)
        if line is None:
            return CallError("raised", f"{call.name}: its worker {why}", call.name)
        reply = pickle.loads(base64.b64decode(line))
        if not reply["ok"]:
            return CallError("raised", f"{call.name} failed: {reply['error']}", call.name)
        return reply["result"]

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._batch.shutdown(wait=False, cancel_futures=True)
        if self.workers is not None:
            self.workers.close()
