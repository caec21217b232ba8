"""Asynchronous RL (``rollout.mode: async``, issue 59): the placement, the weights' travel, the refusals, and under
torchrun the lockstep run equal to the colocated one and the staleness bound as the metrics show it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import run_job, subprocess_env, torchrun

from vlrft.config import ConfigError, load_config
from vlrft.strategies.placement import rollout_rank_set
from vlrft.trainer.async_rl import empty_buffers, flat_buffers, load_buffers, stream_layout
from vlrft.trainer.config import PolicyTrainConfig


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
    ],
)
def test_a_placement_that_leaves_no_trainer_is_refused(world, local, k, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
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


def _policy_run(out: Path, *extra: str, nproc: int = 0, port_offset: int = 0, timeout: float = 600) -> dict:
    """A short colour-task run (the embedded demo's task and tiny model, 4 steps) in ``out``; ``nproc`` > 0 runs it
    under torchrun. Returns its metrics rows, samples and data order."""
    args = [
        "train-policy",
        f"train.output_dir={out}",
        "train.max_steps=4",
        "train.eval_every=0",
        "data.synthetic_eval_size=8",
        "rollout.rollout_batch_size=8",
        "rollout.n_samples_per_prompt=4",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        *extra,
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


@pytest.mark.distributed
def test_lockstep_equals_the_colocated_run(tmp_path):
    """max_staleness 0 with one rollout and one trainer rank (2 gloo processes) samples the same tokens and ends
    with the colocated synchronous run's weights: keyed sampling makes the tokens independent of the rank that
    samples, and a lockstep group is of the current version (no proximal recompute), so the arithmetic is the
    same; measured: bitwise (the bound 1e-6 is the issue's)."""
    sync = _policy_run(tmp_path / "sync", "rollout.keyed_sampling=true")
    lock = _policy_run(
        tmp_path / "lock", "rollout.mode=async", "rollout.asynchronous.max_staleness=0", nproc=2, port_offset=11
    )
    a, b = _weights(tmp_path / "sync"), _weights(tmp_path / "lock")
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6 and diff == 0.0, diff
    assert [s["response"] for s in sync["samples"]] == [s["response"] for s in lock["samples"]]
    assert sync["order"] == lock["order"]
    rewards = lambda run: [r["reward/combined"] for r in run["metrics"] if "reward/combined" in r]  # noqa: E731
    assert rewards(sync) == rewards(lock) and len(rewards(sync)) == 4
    steps = [r for r in lock["metrics"] if "async/staleness_mean" in r]
    assert [r["async/staleness_max"] for r in steps] == [0.0] * 4


@pytest.mark.distributed
def test_one_step_stale_rollouts_on_two_fsdp2_trainers(tmp_path):
    """max_staleness 1 with one rollout and two FSDP2 trainer ranks (3 processes): step 1 trains on version 0, every
    later step on samples exactly one update old, as the histogram says; the trainers' shares are the prompts a
    colocated run draws (the same data order); the decoupled objective's weights and the overlap figures are
    logged."""
    run = _policy_run(
        tmp_path,
        "rollout.mode=async",
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
        assert r["async/rollout_samples_per_s"] > 0 and r["time/weight_publish"] >= 0
        assert r["off_policy/behav_weight_mean"] > 0
    # stale groups: the behaviour policy is not the proximal one, so the weights move off 1
    assert any(abs(r["off_policy/logprob_diff_mean"]) > 0 for r in steps[1:])
    assert [len(o["prompt_ids"]) for o in run["order"]] == [8] * 4
