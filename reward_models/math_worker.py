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
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

MEMORY_LIMIT_BYTES = 2 * 1024**3
STARTUP_TIMEOUT_S = 120.0  # importing sympy on a busy 2-core machine can take a while; not hostile input
_REPO_ROOT = str(Path(__file__).resolve().parents[1])


class _Worker:
    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = _REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "reward_models.math_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            bufsize=0,
        )
        self.buf = b""
        self.ready = False

    def readline(self, deadline: float) -> bytes | None:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # the child died
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def wait_ready(self) -> None:
        if not self.ready:
            line = self.readline(time.monotonic() + STARTUP_TIMEOUT_S)
            if line != b"ready":
                self.kill()
                raise RuntimeError(
                    "the math-verify worker process did not start (python -m reward_models.math_worker); "
                    "check that math-verify is installed: pip install 'math-verify>=0.7'"
                )
            self.ready = True

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


_idle: list[_Worker] = []
_idle_lock = threading.Lock()


def _take() -> _Worker:
    with _idle_lock:
        while _idle:
            w = _idle.pop()
            if w.proc.poll() is None:
                return w
    return _Worker()


def _give_back(w: _Worker) -> None:
    with _idle_lock:
        _idle.append(w)


def prestart(n: int = 1) -> None:
    """Start ``n`` workers now (their import time is then not paid by the first verification)."""
    workers = [_take() for _ in range(n)]
    for w in workers:
        w.wait_ready()
        _give_back(w)


def math_equivalent(gold: str, pred: str, timeout_s: float) -> bool | None:
    """Whether math-verify finds ``pred`` equivalent to ``gold`` (two extracted LaTeX answers).

    Returns None when the check did not finish within ``timeout_s`` (the worker is then killed) or the
    worker failed; the wait for a worker to start is not part of ``timeout_s``.
    """
    w = _take()
    w.wait_ready()
    request = json.dumps({"gold": gold, "pred": pred, "timeout": max(1, math.ceil(timeout_s))}) + "\n"
    try:
        w.proc.stdin.write(request.encode())
        line = w.readline(time.monotonic() + timeout_s)
    except (BrokenPipeError, OSError):
        line = None
    if line is None:
        w.kill()
        _give_back(_Worker())  # warm a replacement while the caller moves on
        return None
    _give_back(w)
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
