"""Worker processes with a hard time limit per request, for code that may hang, crash or eat memory
(math-verify on hostile LaTeX: ``reward_models.math_worker``; user reward functions:
``reward_models.function_worker``; user tools: ``vlrft.tools.worker``).

A worker is ``python -m MODULE`` speaking one line per message over pipes: it prints ``ready`` once
imported, then answers each request line with one reply line. :meth:`WorkerPool.call` takes an idle worker
(or starts one), sends the request and waits at most ``timeout_s`` for the reply; a late or dead worker is
killed and a fresh one started in the background, and the call returns None. Concurrent callers never wait
on each other's hostile inputs. Workers exit when their stdin closes (the parent went away).
"""

from __future__ import annotations

import base64
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

STARTUP_TIMEOUT_S = 120.0  # importing on a busy 2-core machine can take a while; not hostile input
_REPO_ROOT = str(Path(__file__).resolve().parents[1])


class WorkerStartError(RuntimeError):
    pass


class Worker:
    def __init__(self, module: str, env: dict[str, str] | None = None) -> None:
        full = dict(os.environ, **(env or {}))
        full["PYTHONPATH"] = _REPO_ROOT + os.pathsep + full.get("PYTHONPATH", "")
        self.module = module
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=full,
            bufsize=0,
        )
        self.buf = b""
        self.ready = False
        self.eof = False  # the child closed its stdout (it died)

    def readline(self, deadline: float) -> bytes | None:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:  # the child died
                self.eof = True
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def wait_ready(self) -> None:
        if not self.ready:
            line = self.readline(time.monotonic() + STARTUP_TIMEOUT_S)
            if line != b"ready":
                self.kill()
                raise WorkerStartError(f"the worker process python -m {self.module} did not start")
            self.ready = True

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


class WorkerPool:
    """Idle workers of one module (and environment), taken and given back by calling threads."""

    def __init__(self, module: str, env: dict[str, str] | None = None) -> None:
        self.module, self.env = module, env
        self._idle: list[Worker] = []
        self._lock = threading.Lock()
        self.last_exit: int | None = None  # the exit code of the last worker that died or was killed

    def _take(self) -> Worker:
        with self._lock:
            while self._idle:
                w = self._idle.pop()
                if w.proc.poll() is None:
                    return w
        return Worker(self.module, self.env)

    def _give_back(self, w: Worker) -> None:
        with self._lock:
            self._idle.append(w)

    def prestart(self, n: int = 1) -> None:
        """Start ``n`` workers now (their import time is then not paid by the first request)."""
        workers = [self._take() for _ in range(n)]
        for w in workers:
            w.wait_ready()
            self._give_back(w)

    def call(self, request: bytes, timeout_s: float) -> tuple[bytes | None, str]:
        """``(reply line, "")``, or ``(None, why)`` with why ``"timeout"`` (the worker was killed) or
        ``"died (exit code N)"``; the wait for a worker to start is not part of ``timeout_s``."""
        w = self._take()
        w.wait_ready()
        try:
            w.proc.stdin.write(request.rstrip(b"\n") + b"\n")
            line = w.readline(time.monotonic() + timeout_s)
        except (BrokenPipeError, OSError):
            line = None
        if line is None:
            died = w.eof or w.proc.poll() is not None
            w.kill()
            self.last_exit = w.proc.returncode
            self._give_back(Worker(self.module, self.env))  # warm a replacement while the caller moves on
            return None, f"died (exit code {w.proc.returncode})" if died else "timeout"
        self._give_back(w)
        return line, ""

    def close(self) -> None:
        with self._lock:
            for w in self._idle:
                w.kill()
            self._idle.clear()


def serve_pickled(handle: Callable[[Any], Any]) -> None:
    """The worker side of a pickled request/reply protocol (user reward functions and user tools): the address
    space capped at ``VLRFT_WORKER_MEMORY_MB`` (0: no cap; an unbounded allocation gets a ``MemoryError``), stdout
    kept for replies (a print of the user's code goes to stderr), ``ready``, then one base64 pickle per line each
    way; ``handle`` turns a request into its reply and must not raise."""
    import resource  # POSIX only, and only in the worker

    limit = int(os.environ.get("VLRFT_WORKER_MEMORY_MB", "0")) * 2**20
    if limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = sys.stdout.buffer
    sys.stdout = sys.stderr
    out.write(b"ready\n")
    out.flush()
    for raw in sys.stdin.buffer:
        out.write(base64.b64encode(pickle.dumps(handle(pickle.loads(base64.b64decode(raw))))) + b"\n")
        out.flush()
