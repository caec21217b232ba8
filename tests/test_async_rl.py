"""Asynchronous RL (``rollout.mode: async``, issue 59): the placement, the weights' travel, the refusals, and under
torchrun the lockstep run equal to the colocated one and the staleness bound as the metrics show it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import QUIET, run_job, subprocess_env, torchrun
from test_yes_no_learning import AFTER_FORMAT, FORMAT

from vlrft.cli import main
from vlrft.config import ConfigError, load_config
from vlrft.strategies.placement import rollout_rank_set
from vlrft.trainer.async_rl import empty_buffers, flat_buffers, load_buffers, stream_layout
from vlrft.trainer.config import PolicyTrainConfig

REPO = Path(__file__).resolve().parents[1]


def test_rollout_ranks_are_the_first_local_ranks_of_every_node():
    assert rollout_rank_set(2, 2, 1) == [0]
    assert rollout_rank_set(8, 8, 2) == [0, 1]
    assert rollout_rank_set(4, 2, 2) == [0, 2]  # two nodes of two: one rollout rank on each side
    assert rollout_rank_set(8, 4, 4) == [0, 1, 4, 5]
    assert rollout_rank_set(6, 2, 3) == [0, 2, 4]


@pytest.mark.parametrize(
    "world, local, k, message",
    [
        (2, 2, 2, "rollout_ranks=2: must lie in 1..1 for a torchrun world of 2 processes (at least one rank trains)"),
        (4, 2, 1, "rollout_ranks=1: must be a multiple of the 2 nodes (each node gets as many rollout ranks)"),
        (4, 2, 4, "rollout_ranks=4: must lie in 1..3"),
        (1, 1, 1, "rollout.mode=async: needs a torchrun world of at least 2 processes"),
    ],
)
def test_a_placement_that_leaves_no_trainer_is_refused(world, local, k, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        rollout_rank_set(world, local, k)


def test_weights_travel_as_flat_buffers_bitwise(tiny_model):
    """The published buffers load into a differently initialised copy bitwise, per dtype, in the layout's order."""
    from transformers import AutoModelForImageTextToText

    src = AutoModelForImageTextToText.from_pretrained(tiny_model("qwen2_5_vl"))
    dst = AutoModelForImageTextToText.from_pretrained(tiny_model("qwen2_5_vl"))
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p))
    layout = stream_layout(dst)
    buffers = flat_buffers(layout, dict(src.named_parameters()), torch.device("cpu"))
    received = empty_buffers(layout, torch.device("cpu"))
    assert [b.shape for b in received] == [b.shape for b in buffers]
    for r, b in zip(received, buffers):
        r.copy_(b)
    load_buffers(dst, layout, received)
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))
    # a receiver in bfloat16: each tensor cast once, as the engine's own cast would
    half = [(n, s, "torch.bfloat16") for n, s, _ in layout]
    (flat,) = flat_buffers(half, dict(src.named_parameters()), torch.device("cpu"))
    first = next(src.parameters())
    assert flat.dtype == torch.bfloat16 and torch.equal(flat[: first.numel()], first.detach().reshape(-1).bfloat16())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["algorithm.dynamic_sampling=true"],
            "algorithm.dynamic_sampling=true: not with rollout.mode=async",
        ),
        (["rollout.keyed_sampling=false"], "rollout.keyed_sampling=false: rollout.mode=async samples with keyed"),
        (["train.on_collapse=rollback"], "train.on_collapse=rollback: not with rollout.mode=async"),
    ],
)
def test_what_async_cannot_do_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config(PolicyTrainConfig, None, ["rollout.mode=async", *overrides])
    assert load_config(PolicyTrainConfig, None, ["rollout.mode=async"]).rollout.asynchronous.max_staleness == 1


# a short colour-task run's settings: the demo's task and model, 8 prompts x 4 samples a step, no evaluation but the
# first and last on 8 held-out prompts, quiet logs
SHORT = [
    "train.eval_every=0",
    "data.synthetic_eval_size=8",
    "rollout.rollout_batch_size=8",
    "rollout.n_samples_per_prompt=4",
    "logging.wandb=disabled",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
]


def _policy_run(out: Path, *extra: str, nproc: int = 0, port_offset: int = 0, timeout: float = 600) -> dict:
    """A short colour-task run (the embedded demo's task and tiny model, 4 steps) in ``out``; ``nproc`` > 0 runs it
    under torchrun. Returns its metrics rows, samples and data order."""
    configs = [x for x in extra if "=" not in x]  # config files first, then the overrides
    args = [
        "train-policy",
        *configs,
        f"train.output_dir={out}",
        "train.max_steps=4",
        *SHORT,
        *[x for x in extra if "=" in x],
    ]
    import sys

    cmd = (
        torchrun("-m", "vlrft", *args, nproc=nproc, port_offset=port_offset)
        if nproc
        else [sys.executable, "-m", "vlrft", *args]
    )
    res = run_job(cmd, env=subprocess_env(), timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "Traceback" not in res.stderr and "alarm" not in res.stdout, res.stderr[-3000:]
    read = lambda name: [json.loads(x) for x in (out / name).read_text().splitlines()]  # noqa: E731
    return {"metrics": read("metrics.jsonl"), "samples": read("samples.jsonl"), "order": read("data_order.jsonl")}


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def colocated_keyed(tmp_path_factory) -> tuple[Path, dict]:
    """The colocated single-process run with keyed sampling that lockstep runs are compared with (run once)."""
    out = tmp_path_factory.mktemp("colocated") / "sync"
    return out, _policy_run(out, "rollout.keyed_sampling=true")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("copy", ["off", "on"])
def test_lockstep_equals_the_colocated_run(tmp_path, colocated_keyed, copy):
    """max_staleness 0 with one rollout and one trainer rank (2 gloo processes) samples the same tokens and ends
    with the colocated synchronous run's weights: keyed sampling makes the tokens independent of the rank that
    samples, and a lockstep group is of the current version (no proximal recompute), so the arithmetic is the
    same; measured: bitwise (the bound 1e-6 is the issue's). ``copy``: the rollout rank's hf engine generates with an
    inference copy (the GPU default), kept in step with every version (before the fix it sampled the initial weights
    throughout: 6.9e-4 off)."""
    sync_out, sync = colocated_keyed
    lock = _policy_run(
        tmp_path / "lock",
        "rollout.mode=async",
        "rollout.asynchronous.max_staleness=0",
        f"rollout.hf.inference_copy={copy}",
        nproc=2,
        port_offset=11 if copy == "off" else 13,
    )
    a, b = _weights(sync_out), _weights(tmp_path / "lock")
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6 and diff == 0.0, diff
    assert [s["response"] for s in sync["samples"]] == [s["response"] for s in lock["samples"]]
    assert sync["order"] == lock["order"]
    rewards = lambda run: [r["reward/combined"] for r in run["metrics"] if "reward/combined" in r]  # noqa: E731
    assert rewards(sync) == rewards(lock) and len(rewards(sync)) == 4
    steps = [r for r in lock["metrics"] if "async/staleness_mean" in r]
    assert [r["async/staleness_max"] for r in steps] == [0.0] * 4


@pytest.mark.slow
@pytest.mark.distributed
def test_one_step_stale_rollouts_on_two_fsdp2_trainers(tmp_path):
    """max_staleness 1 with one rollout and two FSDP2 trainer ranks (3 processes): step 1 trains on version 0, every
    later step on samples exactly one update old, as the histogram says; the trainers' shares are the prompts a
    colocated run draws (the same data order); the decoupled objective's weights and the overlap figures are
    logged."""
    configs = Path(__file__).resolve().parents[1]
    run = _policy_run(
        tmp_path,
        str(configs / "vlrft" / "trainer" / "demo.yaml"),
        str(configs / "configs" / "policy" / "async.yaml"),  # the shipped overlay: rollout.mode async, staleness 1
        "strategy.name=fsdp2",
        "algorithm.off_policy=decoupled",
        nproc=3,
        port_offset=23,
    )
    steps = [r for r in run["metrics"] if "async/staleness_mean" in r]
    assert [r["async/staleness_mean"] for r in steps] == [0.0, 1.0, 1.0, 1.0]
    assert [r["async/staleness_share/1"] for r in steps] == [0.0, 1.0, 1.0, 1.0]
    assert [r["async/version"] for r in steps] == [0.0, 0.0, 1.0, 2.0]
    for r in steps:
        assert r["async/tokens_at_staleness/0"] + r["async/tokens_at_staleness/1"] > 0
        assert 0.0 <= r["async/trainer_idle_share"] <= 1.0 and 0.0 <= r["async/rollout_idle_share"] <= 1.0
        assert r["async/rollout_samples_per_s"] > 0 and r["async/trainer_samples_per_s"] > 0
        assert r["time/weight_publish"] >= 0
        assert r["off_policy/behav_weight_mean"] > 0
        # partial rollouts off (the default): versions load between steps only, one per sample
        assert r["async/partial_share"] == 0.0 and "async/partial_loads" not in r
    # stale groups: the behaviour policy is not the proximal one, so the weights move off 1
    assert any(abs(r["off_policy/logprob_diff_mean"]) > 0 for r in steps[1:])
    assert [len(o["prompt_ids"]) for o in run["order"]] == [8] * 4


def _rollout_rank_killed(out: Path, sig: int, port_offset: int, until: str = "") -> tuple[int | None, str, float]:
    """A 200-step async run whose rollout rank (global rank 0) gets ``sig`` once step 2 is logged; returns the job's
    exit code, its stderr and the seconds from the signal to the job's end, or, with ``until``, to the first stderr
    line containing it (the job is then ended by the test: torchrun takes 30 s more to end a stopped rank; code
    None)."""
    import os
    import subprocess
    import time

    from launch import kill_tree, process_tree

    cmd = torchrun(
        "-m",
        "vlrft",
        "train-policy",
        "rollout.mode=async",
        f"train.output_dir={out}",
        "train.max_steps=200",
        "strategy.heartbeat_timeout_s=10",
        "logging.progress_bar=false",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        nproc=2,
        port_offset=port_offset,
    )
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = out / "metrics.jsonl", time.time() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.time() < deadline, "the run ended or stalled before step 2"
            time.sleep(0.2)

        def environ(pid: int) -> bytes:
            try:
                return Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                return b""

        (rollout,) = [pid for pid in process_tree(proc.pid) if b"\x00RANK=0\x00" in b"\x00" + environ(pid)]
        t0 = time.time()
        os.kill(rollout, sig)
        if until:
            lines = []
            for line in proc.stderr:  # until the line, or the end of the job's stderr
                lines.append(line)
                if until in line:
                    return None, "".join(lines), time.time() - t0
            return proc.wait(), "".join(lines), time.time() - t0
        _, err = proc.communicate(timeout=240)
        return proc.returncode, err, time.time() - t0
    finally:
        kill_tree(proc)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_rollout_rank_ends_the_run_in_one_line(tmp_path):
    """SIGKILL the rollout rank mid-run: the trainer, waiting for its rollouts or its weights' receipt, stops with one
    line naming the rollout rank and its host (exit code 2 from the trainer; torchrun reports the job failed)."""
    import signal
    import socket

    code, err, seconds = _rollout_rank_killed(tmp_path, signal.SIGKILL, port_offset=31)
    lines = [x for x in err.splitlines() if "rollout rank 0 on" in x or "rank 0 (pid" in x]
    assert code != 0 and seconds < 60, (code, seconds, err[-3000:])
    assert lines and socket.gethostname() in lines[0] and ("is gone" in lines[0]), err[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stopped_rollout_rank_ends_the_run_within_the_heartbeat_timeout(tmp_path):
    """SIGSTOP the rollout rank (alive, silent): the trainer's heartbeat watch names it after
    strategy.heartbeat_timeout_s=10 s and exits with code 2 (torchrun then takes 30 s more to end the stopped rank,
    which the test does not wait for: measured 41 s to the job's end)."""
    import signal

    code, err, seconds = _rollout_rank_killed(tmp_path, signal.SIGSTOP, port_offset=37, until="sent no heartbeat")
    line = next((x for x in err.splitlines() if "sent no heartbeat" in x), "")
    # the rollout rank's last heartbeat (written every second) may be up to a second older than the signal: the line
    # comes 9-11 s after it (measured 11.0 and 9.2), within the timeout plus the watch's own second and some load
    assert code is None and seconds < 40, (code, seconds, err[-3000:])
    assert "rank 0 (pid" in line and "strategy.heartbeat_timeout_s=10" in line, err[-3000:]
    assert int(line.split("sent no heartbeat for ")[1].split(" s")[0]) >= 10, line


DEMO = REPO / "vlrft" / "trainer" / "demo.yaml"


def _async_run(tmp_path: Path, config: Path, staleness: int, *overrides: str, port_offset: int):
    """``config`` with configs/policy/async.yaml and ``overrides`` under torchrun (1 rollout + 1 trainer rank),
    ``staleness`` steps stale, in ``tmp_path / "run"``: the finished job and its metrics rows."""
    out = tmp_path / "run"
    asynchronous = [str(config), str(REPO / "configs" / "policy" / "async.yaml")]
    stale = f"rollout.asynchronous.max_staleness={staleness}"
    cmd = torchrun(
        "-m",
        "vlrft",
        "train-policy",
        *asynchronous,
        stale,
        *overrides,
        f"train.output_dir={out}",
        *QUIET,
        nproc=2,
        port_offset=port_offset,
    )
    res = run_job(cmd, env=subprocess_env(), timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.distributed
# the shipped overlay (configs/policy/async.yaml: decoupled PPO) at half the demo's learning rate, where fifteen seeds
# were measured in every pairing (docs/async.md); one and two steps stale with whole rollouts, two with partial ones
# (staleness 1 with partial rollouts, measured there on fifteen seeds, is left out of the suite for its time)
@pytest.mark.parametrize(
    "staleness, partial", [(1, False), (2, False), (2, True)], ids=["1-whole", "2-whole", "2-partial"]
)
def test_the_colour_demo_learns_under_staleness(tmp_path, staleness, partial):
    """The embedded demo with configs/policy/async.yaml (one rollout and one trainer rank, decoupled PPO),
    ``optim.lr=1e-3``, keyed sampling, ``train.seed=9``, 150 steps, samples 1 or 2 updates old: held-out accuracy
    >= 0.95 at steps 125 and 150, where the synchronous run with the same settings (one process) is 0.75 at step 100
    and 1.0 at 125 and 150: within 1.25 x its steps (156), at two evaluations. Measured (Intel Xeon, the tests' pins,
    2026-12-05, two runs at once): staleness 1 and 2, whole or partial, 1.0 at 125 and 150, as the synchronous run.

    ``partial``: partial rollouts, with the step's prompts generated one at a time
    (``rollout.micro_rollout_batch_size=1``): the demo's answers are one token, so a version can land only between two
    generate calls. The test asserts that versions did land mid-step. When a version lands depends on timing, so a
    partial run is not reproducible: before the 1.25 x bound it varies (0.5 at step 100 in four of five runs of seed
    9, 0.75 in one; 22-64 loads; the tests' pins and MKL_CBWR=COMPATIBLE), and it asserts what held in all five, and
    on all fifteen seeds of docs/async.md's sweep: 1.0 at steps 125 and 150, as the whole runs. (At the demo's own
    learning rate, 2e-3, a CI run stood at 0.75 at step 75, and 1 of 6 runs made with two at once stayed at 0.75 to
    step 150.)"""
    split = ["rollout.asynchronous.partial=true", "rollout.micro_rollout_batch_size=1"] if partial else []
    overrides = ["rollout.keyed_sampling=true", "optim.lr=1e-3", "train.seed=9", *split, "train.max_steps=150"]
    res, rows = _async_run(tmp_path, DEMO, staleness, *overrides, port_offset=50 + staleness + 2 * partial)
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    stale = [r["async/staleness_max"] for r in rows if "async/staleness_max" in r]
    assert max(stale) == staleness, stale[:5]
    loads = sum(r.get("async/partial_loads", 0) for r in rows)
    # with staleness 2 the rollout rank starts a step with the version before the newest, so the newest lands while
    # it samples (52 loads in 150 steps measured, two runs at once); with whole rollouts never
    assert (loads > 0) if partial else (loads == 0), loads
    assert evals[0] == 0.0 and evals[125] >= 0.95 and evals[150] >= 0.95, evals
    assert "alarm" not in res.stdout, res.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.distributed
# one seed per staleness: the one whose synchronous and lagged runs met the bar with room to spare under both
# arithmetic settings measured (the tests' pins and MKL_CBWR=COMPATIBLE); the other seeds are in docs/async.md
@pytest.mark.parametrize("staleness, seed", [(1, 0), (2, 1)], ids=["1-seed0", "2-seed1"])
def test_the_yes_no_task_learns_under_staleness_after_its_warm_start(tmp_path, staleness, seed):
    """GRPO on the yes/no question from its format-only warm start (the recipe of
    tests/test_yes_no_learning.py with ``optim.lr=1e-3`` held constant for 200 steps, keyed sampling, evaluated every
    10 steps, warm start and RL on ``train.seed``) with configs/policy/async.yaml (decoupled PPO): held-out accuracy
    >= 0.9 at every evaluation from step 170 to 200, within 1.25 x the synchronous run's steps at four evaluations.

    The step at which this task first separates its cells is chaotic: the synchronous run of one seed moved from step
    110 to 70 under the other arithmetic setting, that of another from 160 to never (0.5 for 200 steps), so one
    lagged run against one synchronous run is read on the median over five seeds and both settings (docs/async.md,
    "The yes/no test": synchronous 160, one step stale 130, two steps stale 115). Each case here is a seed
    where the claim held under both settings, so the test does not sit on that knife edge (measured 2026-12-05, Intel
    Xeon, first evaluation >= 0.9 held to step 200, pins / COMPATIBLE):

    - one step stale, seed 0: synchronous 140 / 160 (bound 175 / 200), lagged 150 / 160;
    - two steps stale, seed 1: synchronous 170 / 170 (bound 212), lagged 110 / 110.

    The answer is one or two tokens, so with partial rollouts no version lands mid-generation (0 loads in 600 steps
    measured) and those runs are these."""
    # the format-only warm start of the yes/no learning proof (configs/sft/yes_no_format.yaml, 100 steps) on the seed:
    # the answer words in the format, each answer a coin flip, so held-out 0.5
    warm = tmp_path / "format"
    assert main(["train-sft", str(FORMAT), f"train.seed={seed}", f"train.output_dir={warm}", *QUIET]) == 0
    overrides = [
        f"model.path={warm / 'final'}",
        *AFTER_FORMAT,  # the proof's recipe; the overrides after it take the place of its rate and length
        "optim.lr=1e-3",
        "optim.lr_scheduler=constant",
        "train.max_steps=200",
        "train.eval_every=10",
        "rollout.keyed_sampling=true",
        f"train.seed={seed}",
    ]
    _, rows = _async_run(
        tmp_path, REPO / "configs" / "policy" / "yes_no.yaml", staleness, *overrides, port_offset=60 + staleness
    )
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    assert max(r["async/staleness_max"] for r in rows if "async/staleness_max" in r) == staleness
    assert evals[0] <= 0.6 and all(evals[s] >= 0.9 for s in range(170, 201, 10)), evals


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_a_lockstep_async_run_checkpoints_and_continues_bitwise(tmp_path):
    """SIGTERM to torchrun and its ranks (what a scheduler sends): the trainer ends its step, saves a checkpoint and
    stops the rollout rank (which waits for that, not dying on the signal); the samples in flight are dropped. The same
    command resumes: the rollout rank samples from the checkpoint's step and version again, and a lockstep run ends
    with the uninterrupted weights, bitwise."""
    import os
    import re
    import signal
    import subprocess
    import time

    from safetensors.torch import load_file

    def cmd(out: Path, offset: int) -> list[str]:
        args = [
            "train-policy",
            "rollout.mode=async",
            "rollout.asynchronous.max_staleness=0",
            f"train.output_dir={out}",
            "train.max_steps=8",
            "train.log_every=1",
            *SHORT,
        ]
        return torchrun("-m", "vlrft", *args, port_offset=offset)

    ref, run = tmp_path / "ref", tmp_path / "stopped"
    res = run_job(cmd(ref, 61), env=subprocess_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    proc = subprocess.Popen(
        cmd(run, 62),
        env=subprocess_env(),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        rows = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
        if sum('"train/loss"' in r for r in rows) >= 2:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    said = re.findall(r"preempted: stopped by (SIG\w+) after step (\d+)/", err)
    assert len(said) == 1 and said[0][0] == "SIGTERM", err[-3000:]  # the one trainer's line
    step = int(said[0][1])
    assert 2 <= step < 8 and (run / "checkpoints" / f"step-{step:06d}" / "COMPLETE").is_file(), err[-3000:]
    # (torchrun's own agent prints a traceback of the signal it got; no rank failed)
    assert "error" not in err.split("preempted:")[0].lower() or "vlrft" not in err, err[-3000:]
    assert "distributed error" not in err and not (run / "LOCK").exists(), err[-3000:]
    res = run_job(cmd(run, 63), env=subprocess_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    want, got = load_file(str(ref / "final" / "model.safetensors")), load_file(str(run / "final" / "model.safetensors"))
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)  # bitwise


@pytest.mark.slow
@pytest.mark.distributed
def test_two_torchrun_nodes_with_a_rollout_rank_each_equal_the_colocated_fsdp2_run(tmp_path):
    """Two torchrun agents on loopback (two "nodes" of 2 processes) with rollout_ranks=2: one rollout rank on each
    side of the node boundary (global ranks 0 and 2), two FSDP2 trainers (1 and 3). In lockstep the trainers get the
    shares a colocated 2-rank FSDP2 run gives its ranks and keyed sampling draws the same tokens, so the weights are
    that run's: measured bitwise (bound 1e-6)."""
    import socket
    import subprocess
    import sys

    common = ["strategy.name=fsdp2", "train.max_steps=3", "rollout.keyed_sampling=true"]
    sync = _policy_run(tmp_path / "sync", *common, nproc=2, port_offset=71)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "two-nodes"
    args = [
        "train-policy",
        f"train.output_dir={out}",
        *SHORT,
        "rollout.mode=async",
        "rollout.asynchronous.rollout_ranks=2",
        "rollout.asynchronous.max_staleness=0",
        *common,
    ]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2"]
    launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "async-two-nodes"]
    nodes = [
        subprocess.Popen(
            [*launch, "-m", "vlrft", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=subprocess_env(),
        )
        for _ in range(2)
    ]
    logs = [n.communicate(timeout=900)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), "\n".join(x[-3000:] for x in logs)
    assert any("async: 2 rollout rank(s)" in x for x in logs)
    a, b = _weights(tmp_path / "sync"), _weights(out)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6, diff
    assert [r["prompt_ids"] for r in sync["order"]] == [
        json.loads(x)["prompt_ids"] for x in (out / "data_order.jsonl").read_text().splitlines()
    ]
    print(f"two nodes, async lockstep vs colocated FSDP2: max parameter difference {diff}")


def test_scored_groups_travel_pickled_with_their_tensors_as_bytes():
    """The channel's pickling (placement.dumps): every CPU tensor back bitwise with its dtype (bfloat16, which numpy
    lacks, too), shape and strides made contiguous, empty ones, in writable memory of its own; a tensor that needs
    torch's own reduction (one that requires grad) still travels."""
    import pickle

    from vlrft.strategies.placement import dumps

    sent = {
        "ids": torch.arange(5),
        "logprobs": torch.randn(7),
        "empty": torch.zeros(0, 3),
        "half": torch.randn(3, 4).bfloat16(),
        "transposed": torch.randn(4, 2).t(),
        "flags": torch.tensor([True, False]),
        "leaf": torch.ones(2, requires_grad=True),
    }
    got = pickle.loads(dumps([sent, sent["ids"]]))
    for key, value in sent.items():
        back = got[0][key]
        assert back.dtype == value.dtype and back.shape == value.shape and torch.equal(back, value.detach()), key
    assert got[0]["leaf"].requires_grad
    got[0]["ids"][0] = 9  # its own memory: the sender's tensor is untouched
    assert int(sent["ids"][0]) == 0 and got[1] is got[0]["ids"]  # one tensor twice stays one (pickle's memo)
