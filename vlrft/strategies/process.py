"""Process set-up and tear-down around a strategy: joining torchrun's process group (with a collective timeout),
glibc's allocator told to keep freed memory (``strategy.keep_freed_memory``), and the safe end of a process that
joined a group (:func:`finish_process`)."""

from __future__ import annotations

import atexit
import ctypes
import gc
import io
import os
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment; returns (rank, world_size). A collective
    waiting longer than ``timeout_s`` for another rank fails instead of hanging."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    atexit.register(_destroy_process_group)
    return dist.get_rank(), dist.get_world_size()


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4


def mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt(param, value)``; False where the C library has none (macOS) or refuses the value."""
    call = getattr(ctypes.CDLL(None), "mallopt", None)
    return call is not None and bool(call(param, value))


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the memory this process frees for its next allocations: no ``mmap`` per large
    allocation (``M_MMAP_MAX`` 0) and no return of the heap's free top to the system (``M_TRIM_THRESHOLD`` at its
    largest). By default glibc maps every allocation above a threshold (128 KiB, raised as such blocks are freed, at
    most 32 MiB) afresh and unmaps it when freed, and trims the heap, so each training step touches its activations'
    pages anew: a page fault per 4 KiB page, which costs more than the element-wise work that writes it on a virtual
    machine (docs/benchmarks.md: 2-100 k faults per update step of the 21 M benchmark, 0 with this). The process
    keeps its peak memory, as PyTorch's CUDA caching allocator does on a GPU; jemalloc or tcmalloc through
    ``LD_PRELOAD`` (PyTorch's CPU tuning guide) do the same job. Returns whether it applied (False where the C
    library has no ``mallopt``: macOS, or musl's, which ignores it)."""
    return mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, 2**31 - 1)


def _destroy_process_group() -> None:
    """At exit, the process group leaves the registry before the interpreter tears down. That alone does not end
    its worker threads while FSDP2's device meshes still hold the group; ``finish_process`` is what makes the end
    of a distributed process safe."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_IN_GROUPS = False  # this process holds process groups of its own (rollout.mode=async's channels)


def mark_in_groups() -> None:
    """Say that this process holds process groups beside (or instead of) the default one: it then ends through
    :func:`finish_process`'s safe path too."""
    global _IN_GROUPS
    _IN_GROUPS = True


def finish_process(code: int) -> int:
    """End the main function of a process that may have joined a process group: ``return finish_process(code)``.

    Alone, or as the only rank of its group, it returns ``code``. As one rank of several it ends the process here:
    every non-daemon thread joined, Python's exit handlers (the process group's destruction, loggers, trackers),
    every open file's buffer flushed, then ``os._exit(code)``, which skips the interpreter's finalisation, as
    ``multiprocessing`` ends its children. The reason is a race in that finalisation: a gloo worker thread may still
    be releasing a finished collective (its tensors' Python objects) when the main thread starts finalising; that
    thread then needs the GIL, which a finalising interpreter refuses by ending the thread, and the forced unwind
    through a C++ destructor calls ``std::terminate``: SIGABRT, "terminate called without an active exception",
    after all the work is done. Seen about once in 50 two-rank FSDP2 updates under load on 2 cores, with this core
    dump's stack: thread ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherCoalescedWork`` -> ``decref_pyobject`` ->
    ``PyThread_exit_thread`` -> ``std::terminate``, the main thread in ``Py_FinalizeEx``."""
    if not (_IN_GROUPS or (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)):
        return code
    # what the interpreter's exit does before finalising, in its order: threading's exit hooks (a thread pool's
    # idle workers are told to stop) and the join of the non-daemon threads, then the atexit handlers
    getattr(threading, "_shutdown", lambda: None)()
    atexit._run_exitfuncs()
    # what finalisation would have written: every open file object's buffer (a user's reward function may keep a
    # log open), standard output and error last
    # by type, not isinstance: a weak proxy whose object is gone (torch.compile leaves some) raises on isinstance
    files = [
        f for f in gc.get_objects() if issubclass(type(f), io.IOBase) and f is not sys.stdout and f is not sys.stderr
    ]
    for stream in [*files, sys.stdout, sys.stderr]:
        try:
            if not stream.closed and stream.writable():
                stream.flush()
        except Exception:  # closed meanwhile, a broken pipe, a file object of its own kind: the work is done anyway
            pass
    os._exit(code)
