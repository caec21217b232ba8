"""math-verify in a separate worker process, with a hard time limit that works from any thread.

math-verify's own timeout uses ``signal.alarm``, which only works in the main thread, and a parse of
hostile LaTeX (``10^{10^{10}}``, thousands of nested braces) can run for ever or inside one C call that
no signal interrupts. So the comparison runs in a child process (``python -m reward_models.math_worker``)
that speaks JSON lines over pipes: the caller waits at most ``timeout_s`` for the answer and kills the
child when it is late (a fresh one is started in the background). The child parses only the two
extracted answer strings, with math-verify's LaTeX extraction only (``LatexExtractionConfig``, which
reads LaTeX with the latex2sympy grammar); never ``ExprExtractionConfig`` (that one calls
``sympy.parse_expr``, i.e. ``eval``). Its address space is capped at ``MEMORY_LIMIT_BYTES``.

Workers are pooled: a thread takes an idle worker or starts one, so concurrent callers never wait on
each other's hostile inputs. Children exit when their stdin closes (the parent went away).
"""

from __future__ import annotations

import json
import logging
import math
import sys

from vlrft.workers import WorkerPool, WorkerStartError

MEMORY_LIMIT_BYTES = 2 * 1024**3
_pool = WorkerPool("reward_models.math_worker")


def prestart(n: int = 1) -> None:
    """Start ``n`` workers now (their import time is then not paid by the first verification)."""
    try:
        _pool.prestart(n)
    except WorkerStartError as exc:
        raise RuntimeError(f"{exc}; check that math-verify is installed: pip install 'math-verify>=0.7'") from exc


def math_equivalent(gold: str, pred: str, timeout_s: float) -> bool | None:
    """Whether math-verify finds ``pred`` equivalent to ``gold`` (two extracted LaTeX answers).

    Returns None when the check did not finish within ``timeout_s`` (the worker is then killed) or the
    worker failed; the wait for a worker to start is not part of ``timeout_s``.
    """
    request = json.dumps({"gold": gold, "pred": pred, "timeout": max(1, math.ceil(timeout_s))})
    try:
        line, _ = _pool.call(request.encode(), timeout_s)
    except WorkerStartError as exc:
        raise RuntimeError(f"{exc}; check that math-verify is installed: pip install 'math-verify>=0.7'") from exc
    if line is None:
        return None
    reply = json.loads(line)
    return reply["equal"] if reply["ok"] else None


def _serve() -> None:  # runs in the child process
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    logging.disable(logging.CRITICAL)  # math-verify logs whole hostile inputs on timeouts
    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0)]
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for raw in sys.stdin.buffer:
        try:
            req = json.loads(raw)
            t = req["timeout"]
            gold = parse("\\boxed{" + req["gold"] + "}", extraction_config=config, parsing_timeout=t)
            pred = parse("\\boxed{" + req["pred"] + "}", extraction_config=config, parsing_timeout=t)
            reply = {"ok": True, "equal": bool(gold and pred and verify(gold, pred, timeout_seconds=t))}
        except BaseException as exc:  # noqa: BLE001 - any failure is "not verified", reported as such
            reply = {"ok": False, "error": type(exc).__name__}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve()
