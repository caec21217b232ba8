"""Distributed faults (issue 11, item 8): a rank that is killed or stuck makes the others stop within a
bounded, configurable time naming it; a non-finite step is skipped bitwise under FSDP2 and DeepSpeed; two
torchrun "nodes" (c10d rendezvous on the loopback address) train exactly as one node with two processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch import run_job, subprocess_env
from safetensors.torch import load_file
from tolerance import assert_within

from vlrft.errors import DistributedError
from vlrft.liveness import LOST_EXIT_CODE, lost_rank
from vlrft.processes import gone

REPO = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _beat(folder: Path, rank: int, pid: int, host: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{rank}.json"
    path.write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "rank": rank}))
    return path


def test_lost_rank_names_a_killed_or_silent_rank_and_ignores_live_or_ended_ones(tmp_path):
    host = socket.gethostname()
    _beat(tmp_path, 0, os.getpid())
    _beat(tmp_path, 1, os.getpid())
    assert lost_rank(tmp_path, 0, 3, timeout_s=30, host=host) is None  # rank 2 has no file: not watched
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _beat(tmp_path, 2, dead.pid)
    err = lost_rank(tmp_path, 0, 3, timeout_s=30, host=host)
    assert isinstance(err, DistributedError)
    assert str(err) == f"rank 2 (pid {dead.pid} on {host}) is gone (killed or crashed: not running); rank 0 stops"
    (tmp_path / "rank-2.json").unlink()  # a rank that ended cleanly removed its file
    old = time.time() - 45
    os.utime(_beat(tmp_path, 1, os.getpid(), host="node-2"), (old, old))
    err = lost_rank(tmp_path, 0, 3, timeout_s=30, host=host)
    assert "rank 1 (pid" in str(err) and "on node-2) sent no heartbeat for 45 s" in str(err)
    assert "strategy.heartbeat_timeout_s=30" in str(err)


def test_a_watching_rank_exits_with_code_2_naming_a_killed_peer_even_when_blocked(tmp_path):
    """The monitor ends the process from its thread while the main thread is blocked (as in a collective)."""
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    _beat(tmp_path, 1, peer.pid)
    code = (
        "import sys, threading; from vlrft.liveness import LivenessMonitor; "
        f"LivenessMonitor({str(tmp_path)!r}, 0, 2, timeout_s=30, interval_s=0.2).start(); "
        "print('watching', flush=True); threading.Event().wait()"
    )
    watcher = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env()
    )
    assert watcher.stdout.readline().strip() == b"watching"
    peer.kill()
    peer.wait()
    t0 = time.time()
    _, err = watcher.communicate(timeout=30)
    assert watcher.returncode == LOST_EXIT_CODE and time.time() - t0 < 5
    assert f"DistributedError: rank 1 (pid {peer.pid} on {socket.gethostname()}) is gone" in err.decode()


ENDING_RANK = """
import atexit, sys, threading, time, weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import torch, torch.distributed as dist
from vlrft.strategies import finish_process, init_distributed

out, codes = Path(sys.argv[1]), [int(c) for c in sys.argv[2].split(",")]
rank, world = init_distributed()
atexit.register(lambda: (out / f"atexit-{rank}").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(0.5), (out / f"thread-{rank}").write_text("joined"))).start()
pool = ThreadPoolExecutor(1)  # left open: its idle worker is a non-daemon thread that waits for work
pool.submit(time.sleep, 0).result()
for _ in range(20):  # temporaries that the process group's worker threads release
    dist.all_gather_into_tensor(torch.empty(2 * world), torch.full((2,), float(rank)))
dist.barrier()
sys.stdout = open(out / f"stdout-{rank}", "w", buffering=1 << 16)  # written only by a flush
print(f"rank {rank} of {world}", end="")
log = open(out / f"log-{rank}", "w")  # a file kept open and never flushed (as a user's reward function may keep one)
gone = type("Gone", (), {})()
proxy = weakref.proxy(gone)  # a weak proxy whose object is gone, as torch.compile leaves some: isinstance raises on it
del gone
log.write("logged")
finish_process(codes[rank])
(out / f"finalised-{rank}").write_text("after finish_process")
"""


@pytest.mark.distributed
def test_a_rank_ends_through_its_exit_handlers_and_threads_with_its_code_not_the_interpreters_finalisation(tmp_path):
    """``finish_process`` (vlrft.strategies.base) ends each rank of several with ``os._exit`` after Python's exit
    handlers, the non-daemon threads and a flush of every open file: the interpreter's finalisation, where a gloo
    worker thread may abort the process (SIGABRT after the work is done), never runs. Alone it returns the code."""
    from vlrft.strategies import finish_process

    assert finish_process(5) == 5  # this test process joined no group
    script = tmp_path / "ending_rank.py"
    script.write_text(ENDING_RANK)
    for codes in ("0,0", "0,3"):
        out = tmp_path / codes.replace(",", "-")
        out.mkdir()
        res = run_job(_torchrun([str(script), str(out), codes]), env=subprocess_env(), timeout=300)
        if codes == "0,0":
            assert res.returncode == 0, res.stderr[-3000:]
        else:  # torchrun reports the rank's own code (and stops rank 0 if it is still running: not checked below)
            assert res.returncode != 0 and "exitcode  : 3 " in res.stderr, res.stderr[-3000:]
        for rank in (0, 1) if codes == "0,0" else (1,):
            assert (out / f"atexit-{rank}").read_text() == "ran"
            assert (out / f"thread-{rank}").read_text() == "joined"
            assert (out / f"stdout-{rank}").read_text() == f"rank {rank} of 2"
            assert (out / f"log-{rank}").read_text() == "logged"
            assert not (out / f"finalised-{rank}").exists()


HUNG_JOB = """
import json, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
from vlrft.processes import identity
dist.init_process_group("gloo")
rank = dist.get_rank()
Path(sys.argv[1], f"rank-{rank}.json").write_text(json.dumps(identity()))
if rank == 0:
    dist.all_reduce(torch.ones(1))  # rank 1 never joins: this waits for the group's timeout, 30 minutes
time.sleep(3600)
"""


@pytest.mark.distributed
def test_a_job_that_does_not_end_fails_its_test_in_bounded_time_with_every_ranks_stack_and_leaves_no_process(
    tmp_path,
):
    """The tests' ``run_job`` (tests/launch.py): a torchrun job that hangs fails the test at its timeout, not at
    pytest's limit; the failure shows where each rank waited, and no rank is left running (torchrun starts each
    in a session of its own, which killing torchrun alone leaves behind)."""
    script = tmp_path / "hung.py"
    script.write_text(HUNG_JOB)
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        run_job(_torchrun([str(script), str(tmp_path)]), env=subprocess_env(), timeout=30)
    took = time.monotonic() - start
    message = str(failed.value)
    assert "did not end within 30 s" in message, message[-3000:]
    assert f'File "{script}", line 11 in <module>' in message, message[-3000:]  # rank 0, in the collective
    assert f'File "{script}", line 12 in <module>' in message, message[-3000:]  # rank 1, asleep
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    deadline = time.monotonic() + 10  # killed ranks are reaped by init
    while any(gone(r) is None for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(r) is not None for r in ranks), [gone(r) for r in ranks]  # not running, or a zombie
    assert took < 30 + 20, took  # the timeout, the stacks (up to 3 s a rank), the kill


def _torchrun(args: list[str], nproc: int = 2, port: int | None = None) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_port", str(port or _port()), *args,
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
def test_nonfinite_step_is_skipped_bitwise_under_fsdp2_and_deepspeed(tiny_model, tmp_path):
    out = tmp_path / "skip.json"
    script = REPO / "tests" / "dist" / "skip_step.py"
    res = run_job(
        _torchrun([str(script), str(tiny_model("qwen2_5_vl")), str(out), "fsdp2", "deepspeed"]),
        env=subprocess_env(),
        timeout=840,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    for rank in (0, 1):
        report = json.loads(Path(f"{out}.rank{rank}").read_text())
        for name in ("fsdp2", "deepspeed"):
            r = report[name]
            assert r["skipped"] and r["quantity"] in ("loss", "grad_norm"), (rank, name, r)
            assert r["bitwise_unchanged"] and r["optim_tensors"] > 0 and r["lr_unchanged"], (rank, name, r)
            assert r["next_step_applies"], (rank, name, r)


def _train_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "-m", "vlrft", "train-policy", f"model.path={model_dir}", f"train.output_dir={out}",
        "data.eval_source=''", "data.synthetic_train_size=16", "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4", "train.micro_train_batch_size=4",
        "optim.lr=1e-3", "strategy.name=fsdp2", "logging.tensorboard=false", "logging.wandb=disabled",
        "logging.progress_bar=false", *extra,
    ]  # fmt: skip


def _wait_for(path: Path, timeout: float) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.2)
    raise AssertionError(f"{path} never appeared")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("fault", ["killed", "stuck"])
def test_a_lost_rank_ends_the_job_in_bounded_time_naming_it(tiny_model, tmp_path, fault):
    out = tmp_path / "run"
    args = _train_args(tiny_model("qwen2_5_vl"), out, "train.max_steps=400", "strategy.heartbeat_timeout_s=10")
    job = subprocess.Popen(
        _torchrun(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env()
    )
    victim = _wait_for(out / ".liveness" / "rank-1.json", 300)
    time.sleep(3)  # inside the training loop
    t0 = time.time()
    os.kill(victim["pid"], signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    try:
        log, _ = job.communicate(timeout=120)
    finally:
        if fault == "stuck":
            try:
                os.kill(victim["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    elapsed = time.time() - t0
    assert job.returncode != 0
    assert "rank 1" in log.replace("rank : 1", "rank 1").replace("rank: 1", "rank 1"), log[-3000:]
    if fault == "stuck":
        assert "DistributedError: rank 1" in log and "sent no heartbeat" in log, log[-3000:]
    assert elapsed < 60, elapsed
    print(f"{fault} rank 1: job ended {elapsed:.1f} s later")


@pytest.mark.slow
@pytest.mark.distributed
def test_two_torchrun_nodes_train_exactly_as_one_node_with_two_processes(tiny_model, tmp_path):
    model_dir = tiny_model("qwen2_5_vl")
    one = tmp_path / "one-node"
    res = run_job(_torchrun(_train_args(model_dir, one, "train.max_steps=3")), env=subprocess_env(), timeout=840)
    assert res.returncode == 0, res.stderr[-4000:]
    two = tmp_path / "two-nodes"
    port = _port()
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "reliability",
                *_train_args(model_dir, two, "train.max_steps=3"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=subprocess_env(),
        )  # fmt: skip
        for _ in range(2)
    ]
    logs = [n.communicate(timeout=900)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), "\n".join(x[-3000:] for x in logs)
    a = load_file(one / "final" / "model.safetensors")
    b = load_file(two / "final" / "model.safetensors")
    assert sorted(a) == sorted(b)
    diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    # the same two-rank arithmetic (gloo adds two ranks' values, a + b, in either order exactly): expected 0;
    # 1e-6 leaves room for nothing that a real difference in rendezvous or data order would not exceed
    assert_within(diff, 1e-6, "two nodes vs one node: max parameter difference")
    assert any(not torch.equal(a[k], load_file(Path(model_dir) / "model.safetensors")[k]) for k in a)  # it trained
    print(f"two nodes vs one node: max parameter difference {diff}")
