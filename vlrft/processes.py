"""Which process a pid names, for the files that record an owner (the run folder's ``LOCK``, the ranks'
heartbeats in ``vlrft.liveness``).

A pid alone is not an identity: after the owner dies the kernel hands its pid to the next process, and a
reboot starts the count again. :func:`identity` records the pid with the host, the boot (Linux
``/proc/sys/kernel/random/boot_id``) and the process's start time (field 22 of ``/proc/PID/stat``, clock
ticks since boot); :func:`gone` says whether the process so recorded no longer runs, and why. Where
``/proc`` is absent (macOS) only the pid is compared. A record from another host cannot be checked here
(:func:`gone` returns None): the owner's heartbeat says whether it lives.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces and parentheses)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), or None where it cannot be read."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None  # field 22; fields[0] is field 3


def identity() -> dict[str, Any]:
    """This process: pid, host, boot id, start time (ticks since boot) and a readable start date."""
    pid = os.getpid()
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "proc_start": start_ticks(pid),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def gone(record: dict[str, Any]) -> str | None:
    """Why the process ``record`` (from :func:`identity`) no longer runs: ``"not running"``, ``"a zombie"``,
    ``"the host was restarted"`` or ``"its pid now belongs to another process"``; None while it runs, and for a
    record of another host (not checkable here)."""
    if record.get("host") != socket.gethostname():
        return None
    if record.get("boot_id") and _boot_id() and record["boot_id"] != _boot_id():
        return "the host was restarted"
    try:
        pid = int(record.get("pid", 0))
        if pid <= 0:  # kill(0 or -1, 0) would ask about a process group or every process
            return "not running"
        os.kill(pid, 0)
    except (ProcessLookupError, ValueError, OverflowError):
        return "not running"
    except PermissionError:  # alive, another user's
        pass
    fields = stat_fields(pid)
    if fields and fields[0] == "Z":  # killed, not yet reaped by its parent (torchrun)
        return "a zombie"
    now = start_ticks(pid)
    if record.get("proc_start") is not None and now is not None and now != record["proc_start"]:
        return "its pid now belongs to another process"
    return None
