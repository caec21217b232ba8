"""The CPU setting a training process gets from its strategy (docs/strategies.md, "CPU speed settings"): freed host
memory kept for the next tensors (no page faults per step)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# A child process (the setting is process-wide): page faults of ten 64 MiB tensors, each written and freed, before
# and after a strategy of ``keep_freed_memory`` is made (after two more tensors: the first after the switch grows the
# heap, and a small allocation carved out of the freed block can make the next grow it once more). After the switch
# the fewest of three such rounds: the heap settles (a CI run beside a parallel suite saw three growths in one round),
# where with mmap every round maps all ten afresh.
_CHILD = """
import json, resource, sys, torch
from vlrft.strategies import StrategyConfig, make_strategy

def faults():
    for _ in range(2):
        torch.ones(16 * 2**20)  # 64 MiB, written, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        torch.ones(16 * 2**20)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

first = faults()
make_strategy(StrategyConfig(keep_freed_memory=sys.argv[1]))
print(json.dumps([first, min(faults() for _ in range(3))]))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's (macOS, musl: not applied)")
@pytest.mark.parametrize("setting", ["auto", "no"])
def test_a_cpu_strategy_keeps_freed_memory_so_tensors_do_not_page_fault_anew(setting):
    out = subprocess.run([sys.executable, "-c", _CHILD, setting], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"keep_freed_memory={setting}: page faults of ten 64 MiB tensors {before} before, {after} after")
    # glibc maps each 64 MiB tensor afresh (above its largest mmap threshold): 16 k faults of 4 KiB pages each, or 32
    # of 2 MiB where transparent huge pages are always on; kept memory is written without any (measured 0; a heap
    # that grows once more, as under a parallel test run, costs one tensor's 16 k: a quarter leaves room for two in
    # the settled round)
    assert before >= 10 * 32
    if setting == "auto":  # on CPU: on
        assert after * 4 < before
    else:
        assert after * 2 > before
