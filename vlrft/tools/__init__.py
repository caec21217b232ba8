"""Tools the policy can call in multi-turn rollouts (docs/tools.md): the tool seam (``base``), the built-in tools
(``builtin``), a run's tools (``box``: config, loading, calls under a time limit) and the trajectory environment
(``environment``)."""

from vlrft.tools.base import CallError, Tool, ToolCall, ToolResult, format_tool_call, parse_tool_calls
from vlrft.tools.box import ToolBox, ToolsConfig, check_tools, load_tools
from vlrft.tools.builtin import BUILTIN_TOOLS, ImageView, ToolContext, calculate

__all__ = [
    "BUILTIN_TOOLS",
    "CallError",
    "ImageView",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolContext",
    "ToolResult",
    "ToolsConfig",
    "calculate",
    "check_tools",
    "format_tool_call",
    "load_tools",
    "parse_tool_calls",
]
