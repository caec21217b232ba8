"""The worker process of user tools (``python -m vlrft.tools.worker``, pooled by ``vlrft.workers``): a request is
``{"spec", "arguments", "images"}``; the reply ``{"ok": True, "result": ToolResult}`` or ``{"ok": False, "error":
"file:line: Type: message"}``."""

from __future__ import annotations

import traceback
from typing import Any

from vlrft.tools.box import call_user_tool
from vlrft.user_code import load_callable
from vlrft.workers import serve_pickled


def _handle(req: dict[str, Any]) -> dict[str, Any]:
    try:
        fn = load_callable(req["spec"], "tools.names")
        return {"ok": True, "result": call_user_tool(fn, req["arguments"], req["images"])}
    except BaseException as exc:  # noqa: BLE001 - the user's failure, located, is the model's observation
        frames = traceback.extract_tb(exc.__traceback__)
        at = f"{frames[-1].filename}:{frames[-1].lineno}: " if frames else ""
        return {"ok": False, "error": f"{at}{type(exc).__name__}: {str(exc)[:200]}"}


if __name__ == "__main__":
    serve_pickled(_handle)
