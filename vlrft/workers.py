"""Worker processes with a hard time limit per request, for code that may hang, crash or eat memory
(math-verify on hostile LaTeX: ``reward_models.math_worker``; user reward functions:
``reward_models.function_worker``; user tools: ``vlrft.tools.worker``).

A worker is ``python -m MODULE`` speaking one line per message over pipes: it prints ``ready`` once
imported, then answers each request line with one reply line. :meth:`WorkerPool.call` takes an idle worker
(or starts one), sends the request and waits at most ``timeout_s`` for the reply; a late or dead worker is
killed and a fresh one started in the background, and the call returns None. Concurrent callers never wait
on each other's hostile inputs. Workers exit when their stdin closes (the parent went away).

Each worker leads its own process group: killing it (a timeout, :meth:`WorkerPool.close`) kills whatever its
code started too. It sees only the allow-listed environment (:func:`worker_env`: no tokens or keys of the
trainer's environment). A pool with a ``log`` label writes what its workers print (``print``, ``os.system``
output, tracebacks) to one log file per worker (:func:`log_folder`); the replies travel on a private descriptor
(:func:`serve_pickled`), so nothing user code writes can corrupt them.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import fnmatch
import itertools
import os
import pickle
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

STARTUP_TIMEOUT_S = 120.0  # importing on a busy 2-core machine can take a while; not hostile input
LOG_CAP_BYTES = 64 * 2**20  # a worker's log past this is emptied (with a note) after the request that passed it
_REPO_ROOT = str(Path(__file__).resolve().parents[1])

# the trainer's environment a worker sees (secrets, tokens and keys stay out); VLRFT_WORKER_ENV adds names
WORKER_ENV = tuple(
    """PATH HOME USER LOGNAME SHELL LANG LANGUAGE LC_* TZ TERM TMPDIR TEMP TMP PYTHONPATH PYTHONHASHSEED PYTHONWARNINGS
    PYTHONIOENCODING PYTHONDONTWRITEBYTECODE VIRTUAL_ENV CONDA_PREFIX LD_LIBRARY_PATH OMP_NUM_THREADS MKL_NUM_THREADS
    OPENBLAS_NUM_THREADS TOKENIZERS_PARALLELISM CUDA_VISIBLE_DEVICES HF_HOME HF_HUB_CACHE HF_HUB_OFFLINE
    HF_DATASETS_OFFLINE TRANSFORMERS_OFFLINE XDG_CACHE_HOME ATEN_CPU_CAPABILITY MKL_CBWR ONEDNN_MAX_CPU_ISA VLRFT_DEBUG
    VLRFT_WORKER_*""".split()
)
_run_logs: list[Path] = []  # the folders of the runs that are on (innermost last)


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker: the variables of this process that :data:`WORKER_ENV` or
    ``VLRFT_WORKER_ENV`` (comma-separated names, ``*`` patterns allowed) name, then ``extra``."""
    names = WORKER_ENV + tuple(n.strip() for n in os.environ.get("VLRFT_WORKER_ENV", "").split(",") if n.strip())
    env = {k: v for k, v in os.environ.items() if any(fnmatch.fnmatchcase(k, n) for n in names)}
    env.update(extra or {})
    env["PYTHONPATH"] = _REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@contextlib.contextmanager
def worker_logs(folder: str | Path) -> Iterator[None]:
    """While inside, workers started in this process log to ``folder`` (a run's ``logs/workers``)."""
    _run_logs.append(Path(folder))
    try:
        yield
    finally:
        _run_logs.remove(Path(folder))


def log_folder() -> Path:
    """Where worker logs go: ``VLRFT_WORKER_LOG_DIR`` if set, else the folder of the run that is on
    (:func:`worker_logs`), else ``vlrft-worker-logs`` in the temporary folder."""
    given = os.environ.get("VLRFT_WORKER_LOG_DIR")
    if given:
        return Path(given)
    return _run_logs[-1] if _run_logs else Path(tempfile.gettempdir()) / f"vlrft-worker-logs-{os.getuid()}"


class WorkerStartError(RuntimeError):
    pass


_started = itertools.count()  # numbers the log files of this process's workers
_live: weakref.WeakSet[Worker] = weakref.WeakSet()  # started, not yet killed: killed at exit with their groups


@atexit.register
def _kill_live_workers() -> None:
    """A pool nobody closed (the run ended by an exception, a module-level pool) leaves nothing running."""
    for w in list(_live):
        if w.proc.returncode is None:  # not reaped: its pid still names its group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.proc.pid, signal.SIGKILL)
        w.drop_empty_log()


class Worker:
    def __init__(self, module: str, env: dict[str, str] | None = None, log: str | None = None) -> None:
        self.module = module
        self.log_path: Path | None = None
        err: Any = subprocess.DEVNULL
        if log is not None:
            folder = log_folder()
            folder.mkdir(parents=True, exist_ok=True)
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", log)[:64]
            self.log_path = folder / f"{name}.{os.getpid()}.{next(_started)}.log"
            err = open(self.log_path, "ab")  # noqa: SIM115 - the child's stderr, closed once handed over
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=worker_env({**(env or {}), "VLRFT_WORKER_LOG": str(self.log_path or "")}),
                bufsize=0,
                start_new_session=True,  # its own process group: killed with whatever it starts
            )
        finally:
            if log is not None:
                err.close()
        _live.add(self)
        self.buf = bytearray()
        self.ready = False
        self.eof = False  # the child closed its stdout (it died)

    def readline(self, deadline: float) -> bytes | None:
        """The next reply line, read in linear time (a reply may be a tool's image of tens of megabytes)."""
        fd = self.proc.stdout.fileno()
        start = 0
        while (end := self.buf.find(b"\n", start)) < 0:
            start = len(self.buf)  # only the new bytes are searched next time
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:  # the child died
                self.eof = True
                return None
            self.buf += chunk
        line = bytes(self.buf[:end])
        del self.buf[: end + 1]
        return line

    def wait_ready(self) -> None:
        if not self.ready:
            line = self.readline(time.monotonic() + STARTUP_TIMEOUT_S)
            if line != b"ready":
                self.kill()
                raise WorkerStartError(f"the worker process python -m {self.module} did not start")
            self.ready = True

    def kill(self) -> None:
        """Kill the worker and its process group (what its code started), reap it, and drop an empty log."""
        try:  # the group outlives its leader while a member lives; its id is not reused meanwhile
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        _live.discard(self)
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()
        self.drop_empty_log()

    def drop_empty_log(self) -> None:
        with contextlib.suppress(OSError):
            if self.log_path is not None and self.log_path.stat().st_size == 0:
                self.log_path.unlink()


class WorkerPool:
    """Idle workers of one module (and environment), taken and given back by calling threads. ``log``: the name
    their log files start with (None: what they print is dropped)."""

    def __init__(self, module: str, env: dict[str, str] | None = None, log: str | None = None) -> None:
        self.module, self.env, self.log = module, env, log
        self._idle: list[Worker] = []
        self._busy: set[Worker] = set()
        self._closed = False
        self._lock = threading.Lock()
        self.last_exit: int | None = None  # the exit code of the last worker that died or was killed

    def _take(self) -> Worker:
        with self._lock:
            while self._idle:
                w = self._idle.pop()
                if w.proc.poll() is None:
                    self._busy.add(w)
                    return w
                w.kill()  # died while idle: what it started goes with it
        w = Worker(self.module, self.env, self.log)
        with self._lock:
            self._busy.add(w)
        return w

    def _give_back(self, w: Worker) -> None:
        with self._lock:
            self._busy.discard(w)
            if not self._closed:
                self._idle.append(w)
                return
        w.kill()

    def _drop(self, w: Worker) -> None:
        """Kill a taken worker that failed, and warm a replacement while the caller moves on."""
        w.kill()
        with self._lock:
            self._busy.discard(w)
            if self._closed:
                return
        self._give_back(Worker(self.module, self.env, self.log))

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
        try:
            w.wait_ready()
        except WorkerStartError:
            with self._lock:
                self._busy.discard(w)
            raise
        try:
            w.proc.stdin.write(request.rstrip(b"\n") + b"\n")
            line = w.readline(time.monotonic() + timeout_s)
        except (BrokenPipeError, OSError):
            line = None
        if line is None:
            died = w.eof or w.proc.poll() is not None
            self._drop(w)
            self.last_exit = w.proc.returncode
            return None, f"died (exit code {w.proc.returncode})" if died else "timeout"
        self._give_back(w)
        return line, ""

    def close(self) -> None:
        """Kill every worker with its process group: the idle ones now, a busy one's group too (its caller sees it
        die and reaps it)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for w in idle:
            w.kill()
        for w in busy:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.proc.pid, signal.SIGKILL)


def serve_pickled(handle: Callable[[Any], Any]) -> None:
    """The worker side of a pickled request/reply protocol (user reward functions and user tools): the address
    space capped at ``VLRFT_WORKER_MEMORY_MB`` (0: no cap; an unbounded allocation gets a ``MemoryError``);
    requests and replies on private copies of descriptors 0 and 1, then descriptor 0 read from ``/dev/null`` and
    descriptor 1 (``print``, ``os.system``) written where descriptor 2 goes (the worker's log): nothing the user's
    code reads or writes touches the protocol. ``ready``, then one base64 pickle per line each way; ``handle``
    turns a request into its reply and must not raise."""
    import resource  # POSIX only, and only in the worker

    limit = int(os.environ.get("VLRFT_WORKER_MEMORY_MB", "0")) * 2**20
    if limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    requests, replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)
    os.close(nothing)
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout.reconfigure(line_buffering=True)  # a print reaches the log in order with fd-level writes
    replies.write(b"ready\n")
    replies.flush()
    for raw in requests:
        reply = handle(pickle.loads(base64.b64decode(raw)))
        sys.stdout.flush()
        sys.stderr.flush()
        replies.write(base64.b64encode(pickle.dumps(reply)) + b"\n")
        replies.flush()
        with contextlib.suppress(OSError):
            if os.fstat(1).st_size > LOG_CAP_BYTES:  # opened for appending: the next line starts the file
                os.ftruncate(1, 0)
                os.write(1, f"[vlrft: this log passed {LOG_CAP_BYTES >> 20} MB and was emptied]\n".encode())
    with contextlib.suppress(OSError):  # the parent went away (perhaps killed): an empty log is not kept
        if os.environ.get("VLRFT_WORKER_LOG") and os.fstat(1).st_size == 0:
            os.unlink(os.environ["VLRFT_WORKER_LOG"])
