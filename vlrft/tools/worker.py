"""The worker process of user tools (``python -m vlrft.tools.worker``, pooled by ``vlrft.workers``): a request is
``{"spec", "arguments", "images", "max_chars"}``; the reply ``{"ok": True, "result": ToolResult}`` (its text cut to
``max_chars`` here, before it crosses the pipe) or ``{"ok": False, "error": "file:line: Type: message"}``."""

from __future__ import annotations

from typing import Any

from vlrft.tools.box import call_user_tool, failure
from vlrft.user_code import load_callable
from vlrft.workers import serve_pickled


def _handle(req: dict[str, Any]) -> dict[str, Any]:
    fn = None
    try:
        fn = load_callable(req["spec"], "tools.names")
        return {"ok": True, "result": call_user_tool(fn, req["arguments"], req["images"], req["max_chars"])}
    except BaseException as exc:  # noqa: BLE001 - the user's failure, located, is the model's observation
        return {"ok": False, "error": failure(exc, fn)}


if __name__ == "__main__":
    serve_pickled(_handle)
