"""How tests start vlrft in other processes: the environment (this checkout first on the path, one
thread per process, a DeepSpeed kernel cache of its own), torchrun command lines, and how a job is run and,
when it does not end, stopped with every process it started."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlrft.processes import stat_fields

REPO = Path(__file__).resolve().parents[1]
# the overrides that keep a test's run quiet: no wandb, no progress bar, no TensorBoard files
QUIET = ["logging.wandb=disabled", "logging.progress_bar=false", "logging.tensorboard=false"]


# A second arithmetic setting on one machine: MKL's conditional numerical reproducibility in its COMPATIBLE branch
# makes a row of a float32 matmul round differently with the number of rows in the batch (on the AMD EPYC here,
# tests/test_cpu_matmul.py::test_the_second_arithmetic_setting_makes_rows_depend_on_the_batch), as the default
# kernels of an Intel Xeon (AVX-512) did. A result that is bitwise only by the luck of one CPU's kernels (the DPO
# reference recomputed in another batch after a resume did) fails under it; resume and learning proofs run under it.
SECOND_ARITHMETIC = {"MKL_CBWR": "COMPATIBLE"}


def subprocess_env(**extra: str) -> dict[str, str]:
    # PYTHONFAULTHANDLER: a process that crashes, or that run_job stops with SIGABRT, prints every thread's stack
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **extra)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    return env


def torchrun(*target: str, nproc: int = 2, port_offset: int = 0) -> list[str]:
    """``torchrun --nproc_per_node NPROC --master_port PORT TARGET...``; TARGET is a script and its
    arguments, or ``"-m", "vlrft", COMMAND, ...``. The port depends on the test process and ``port_offset``
    so that runs of one test (and parallel test processes) do not collide."""
    port = 29500 + (os.getpid() + 97 * port_offset) % 2000
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(port),
        *target,
    ]


def process_tree(pid: int) -> list[int]:
    """``pid``'s descendants, read from /proc. torchrun starts each rank in a session of its own, so killing
    torchrun's process group leaves its ranks running, and once torchrun is gone they are no longer its children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = stat_fields(int(entry.name))  # None for a process that ended meanwhile
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry.name))  # fields[1]: the parent's pid
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def kill_tree(proc: "subprocess.Popen", dump_s: float = 0.0) -> None:
    """SIGKILL ``proc`` and every process it started (torchrun's ranks included), and reap it. With ``dump_s``,
    first SIGABRT the descendants: a Python one started with ``subprocess_env()`` (PYTHONFAULTHANDLER) prints
    every thread's stack, which says where a hung rank waits; each gets up to ``dump_s`` seconds to write it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGSTOP)  # no new child while the tree is read
    tree = process_tree(proc.pid)
    if dump_s:
        for pid in tree:  # one at a time: stacks written at once interleave on the stderr the ranks share
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
            deadline = time.monotonic() + dump_s
            while (fields := stat_fields(pid)) and fields[0] != "Z" and time.monotonic() < deadline:
                time.sleep(0.05)  # until it has written them and died (a zombie: its parent is stopped)
    for pid in [proc.pid, *tree]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def run_job(cmd: list[str], *, env: dict[str, str], timeout: float, cwd: Path | None = None):
    """``subprocess.run(cmd, capture_output=True, text=True, ...)`` for a job that may start other processes (a
    torchrun job, a trainer). A job that does not end within ``timeout`` seconds (keep it below pytest's
    900-second limit), or a test interrupted meanwhile, leaves no process behind: the job's tree is stopped, its
    Python processes' stacks printed, every process killed, and the test fails naming the command with the end of
    its output (the stacks)."""
    # the SIGABRT below is to print stacks, not to write a core file per rank: no core files in this process and
    # what it starts (set here, not in a preexec_fn, which is unsafe in a process with threads such as pytest-xdist's)
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as exc:
        kill_tree(proc, dump_s=3.0)
        try:  # a process outside the tree (one that left it) may still hold the pipes
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out, err = "", "(the output was not read: a process that left the job's tree holds its pipes)"
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        pytest.fail(
            f"{' '.join(map(str, cmd))} did not end within {timeout:g} s; its processes were killed. The end of "
            f"its output (each Python process's stacks last):\n{out[-3000:]}\n{err[-20000:]}",
            pytrace=False,
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_when(proc: "subprocess.Popen", path: Path, timeout: float = 600, poll: float = 0.01) -> None:
    """SIGKILL ``proc`` and every process it started as soon as ``path`` exists (or the process has ended, or
    ``timeout`` seconds passed), and reap it."""
    deadline = time.time() + timeout
    while not path.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(poll)
    kill_tree(proc)
