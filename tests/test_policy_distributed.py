"""FSDP2 and DeepSpeed ZeRO-2 under torchrun (2 gloo processes) update the policy exactly like one
process does on the same global batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from launch import run_job, subprocess_env, torchrun
from safetensors.torch import load_file
from tolerance import assert_within

from vlrft.archs import ARCHS

SCRIPT = Path(__file__).parent / "dist" / "one_update.py"
REPO = Path(__file__).resolve().parents[1]


def _run(args, nproc):
    _run_script(SCRIPT.name, args, nproc)


def _run_script(name, args, nproc):
    """Run ``tests/dist/NAME`` alone (nproc 1) or under torchrun with ``nproc`` gloo processes."""
    script = SCRIPT.parent / name
    if nproc == 1:
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = torchrun(str(script), *args, nproc=nproc)
    res = run_job(cmd, env=subprocess_env(), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]


@pytest.fixture(scope="module")
def single_update(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "single.pt"
    _run([str(tiny_model("qwen2_5_vl")), str(out), "single"], 1)
    return torch.load(out)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "strategy, stage, forward", [("fsdp2", "2", "shared"), ("deepspeed", "2", "shared"), ("fsdp2", "2", "plain")]
)
def test_two_ranks_equal_one_process(tiny_model, tmp_path, single_update, strategy, stage, forward):
    """Two ranks make the one-process update (group-shared forward); with the plain per-sample forward
    (``train.shared_prompt_forward=false``) too."""
    out = tmp_path / f"{strategy}.pt"
    _run([str(tiny_model("qwen2_5_vl")), str(out), strategy, stage, forward], 2)
    got = torch.load(out)
    ref = single_update["state"]
    initial = __import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(tiny_model("qwen2_5_vl") / "model.safetensors")
    )
    assert set(got["state"]) == set(ref)
    moved = max((ref[k].double() - initial[k].double()).abs().max().item() for k in ref if k in initial)
    assert moved > 5e-4  # the update is real (Adam, lr 1e-3: about lr per parameter) ...
    diff = max((got["state"][k].double() - ref[k].double()).abs().max().item() for k in ref)
    # ... and identical across strategies. The bound: Adam's first step moves a parameter by
    # lr * g / (|g| + eps), whose slope in g is at most lr / eps. With the usual eps = 1e-8 that slope is 1e5, and
    # a gradient element that cancels to float32 noise (|g| ~ 1e-9) moves by up to lr whichever its last bits:
    # the comparison would measure the CPU's reduction order (1.0e-5 and 1.7e-5 on an AVX-512 EPYC). The
    # update runs with eps = 1e-4 (one_update.py): slope <= lr / eps = 10. Two reduction orders give float32
    # gradients that differ by at most ~1e-6 (~100 ulps of elements up to ~0.1), so the parameters agree within
    # 10 * 1e-6 = 1e-5 (measured: 2.8e-8).
    assert_within(diff, 1e-5, f"{strategy}-{forward}: max |param difference| after one Adam step")
    assert single_update["metrics"]["policy/clip_fraction"] == 0.0


@pytest.mark.slow  # about 3 minutes each on a 2-core CPU (two processes compiling): kept out of the default suite
@pytest.mark.distributed
@pytest.mark.parametrize(
    "strategy, stage, checkpointing", [("fsdp2", "2", "true"), ("deepspeed", "3", "false")], ids=["fsdp2", "zero3"]
)
def test_compiled_blocks_on_two_ranks_equal_one_eager_process(
    tiny_model, tmp_path, single_update, strategy, stage, checkpointing
):
    """``strategy.compile_blocks`` under FSDP2 (with gradient checkpointing: the backward recomputes each compiled
    block between FSDP2's gather and release, as a 3B model on one 80 GB card trains) and ZeRO-3 on 2 ranks: each
    block's compiled forward runs between the strategy's gather and release hooks, and the update is the one eager
    process's (the bound above: the compiled blocks' float32 roundings, tests/test_compile_blocks.py, are of the
    size of the reduction orders' ones)."""
    out = tmp_path / f"{strategy}-compiled.pt"
    _run(
        [
            str(tiny_model("qwen2_5_vl")),
            str(out),
            strategy,
            stage,
            "shared",
            "0",
            "even",
            "strategy.compile_blocks=true",
            f"strategy.gradient_checkpointing={checkpointing}",
        ],
        2,
    )
    ref, got = single_update["state"], torch.load(out)["state"]
    assert set(got) == set(ref)
    diff = max((got[k].double() - ref[k].double()).abs().max().item() for k in ref)
    assert_within(diff, 1e-5, f"{strategy} with compiled blocks: max |param difference| after one Adam step")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "strategy, stage, nproc",
    [("single", "2", 1), ("fsdp2", "2", 2), ("deepspeed", "3", 2)],
    ids=["single", "fsdp2", "zero3"],
)
def test_onednn_linear_layers_update_as_mkl_does(tiny_model, tmp_path, single_update, strategy, stage, nproc):
    """``strategy.cpu_matmul=onednn`` (every linear layer's products by oneDNN, forward and backward;
    tests/test_cpu_matmul.py) in one process and on 2 ranks under FSDP2 (gathered weights) and ZeRO-3 (weights gathered
    in the forward and again in the backward) makes the one-process update with MKL's products (the bound of
    test_two_ranks_equal_one_process: two summation orders of the float32 gradients, eps = 1e-4, slope <= 10)."""
    out = tmp_path / f"{strategy}-onednn.pt"
    _run(
        [str(tiny_model("qwen2_5_vl")), str(out), strategy, stage, "shared", "0", "even", "strategy.cpu_matmul=onednn"],
        nproc,
    )
    got = torch.load(out)
    assert got["onednn_linears"] > 0 and single_update["onednn_linears"] == 0
    ref = single_update["state"]
    assert set(got["state"]) == set(ref)
    diff = max((got["state"][k].double() - ref[k].double()).abs().max().item() for k in ref)
    assert_within(diff, 1e-5, f"{strategy} with oneDNN linear layers: max |param difference| after one Adam step")


@pytest.fixture(scope="module")
def single_uneven(tiny_model, tmp_path_factory):
    """The one-process update (fixed micro-batches of 3) on the samples of the uneven ranks below (14 in all)."""
    out = tmp_path_factory.mktemp("dist") / "single-uneven.pt"
    _run([str(tiny_model("qwen2_5_vl")), str(out), "single", "2", "shared", "0", "uneven"], 1)
    return torch.load(out)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy, stage, forward", [("fsdp2", "2", "shared"), ("deepspeed", "3", "plain")])
def test_token_budget_micro_batches_keep_unequal_ranks_in_step(
    tiny_model, tmp_path, single_uneven, strategy, stage, forward
):
    """``train.micro_batch_tokens`` with ranks holding 8 and 6 samples: a budget of 1 token makes every sample its
    own micro-batch, so rank 1 runs two zero-weight padding micro-batches (FSDP2 and ZeRO-3 gather parameters in
    every forward: unequal counts would hang) and the update is the one process's with fixed micro-batches."""
    out = tmp_path / f"{strategy}.pt"
    _run([str(tiny_model("qwen2_5_vl")), str(out), strategy, stage, forward, "1", "uneven"], 2)
    ref, got = single_uneven, torch.load(out)
    assert got["samples_and_micro_batches"] == [(8, 8), (6, 8)]
    assert ref["samples_and_micro_batches"] == [(14, 5)]
    # the bound of test_two_ranks_equal_one_process (the same update, eps = 1e-4: slope <= 10)
    diff = max((got["state"][k].double() - v.double()).abs().max().item() for k, v in ref["state"].items())
    assert_within(diff, 1e-5, f"{strategy}-{forward} budget, uneven ranks: max |param difference| after one Adam step")


@pytest.mark.distributed
@pytest.mark.parametrize("strategy, stage", [("fsdp2", "2"), ("deepspeed", "3")])
def test_train_policy_runs_under_torchrun(tiny_model, tmp_path, strategy, stage):
    """Generation on sharded parameters (lockstep), held-out eval, checkpoint and export under torchrun."""
    import json

    cmd = torchrun(
        "-m",
        "vlrft",
        "train-policy",
        f"model.path={tiny_model('qwen2_5_vl')}",
        f"train.output_dir={tmp_path}",
        f"strategy.name={strategy}",
        f"strategy.zero_stage={stage}",
        "train.max_steps=2",
        "data.synthetic_eval_size=6",
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
    )
    res = run_job(cmd, env=subprocess_env(), timeout=840)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval_after"]["num_prompts"] == 6
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/combined" in r] == [1, 2]
    # the run's logs are written once (rank 0), not once per rank
    order = [json.loads(x) for x in (tmp_path / "data_order.jsonl").read_text().splitlines()]
    assert [r["step"] for r in order] == [1, 2] and all(len(r["prompt_ids"]) == 4 for r in order)
    samples = [json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sorted(set(samples)) == [1, 2] and len(samples) == 2 * 4  # train.log_samples=4 per step
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "final")
    assert sum(p.numel() for p in model.parameters()) > 0


NEW_ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_vl_moe")
# micro-batches of 4 samples: one prompt's group each, on one process and on two ranks
GROUP_MICRO_BATCHES = ["0", "even", "train.micro_train_batch_size=4"]


@pytest.fixture(scope="module")
def single_updates(tiny_model, tmp_path_factory):
    """The one-process update of each new architecture (issue 60), plain per-sample forward (computed once each)."""
    done: dict[str, dict] = {}

    def get(arch: str) -> dict:
        if arch not in done:
            out = tmp_path_factory.mktemp("dist-new") / f"{arch}-single.pt"
            _run([str(tiny_model(arch)), str(out), "single", "2", "plain", *GROUP_MICRO_BATCHES], 1)
            done[arch] = torch.load(out)
        return done[arch]

    return get


@pytest.mark.slow  # six jobs of 15-40 s each
@pytest.mark.distributed
@pytest.mark.parametrize(
    "arch, strategy, stage",
    # each arch once, each strategy on an MoE model (all six pairs measured on 2026-12-02, docs/tiny-models.md);
    # text Qwen3 under both
    [
        ("qwen3_5", "fsdp2", "2"),
        ("qwen3_5_moe", "deepspeed", "3"),
        ("qwen3_vl_moe", "fsdp2", "2"),
        ("qwen3", "fsdp2", "2"),
        ("qwen3", "deepspeed", "3"),
    ],
)
def test_new_archs_on_two_ranks_equal_one_process(tiny_model, tmp_path, single_updates, arch, strategy, stage):
    """Qwen3.5 (hybrid linear attention), Qwen3.5-MoE and Qwen3-VL-MoE (issue 60): FSDP2 and DeepSpeed ZeRO-3 on two
    gloo ranks, each rank on the group-shared forward, make the one-process update of the plain per-sample forward
    within the bound of :func:`test_two_ranks_equal_one_process` (Adam eps 1e-4: slope <= 10; float32 gradients of
    two reduction orders within ~1e-6, and the two forwards' gradients within ~1e-7 of the whole gradient,
    tests/test_qwen3_5_moe_archs.py; so 1e-5), every parameter present and the update real. The hybrids take the
    cached path (each prompt's forward once, its linear-attention states carried into each sample's continuation: two
    forwards of the sharded model before one backward), Qwen3-VL-MoE the packed rows. The MoE models train with their
    router's load-balancing loss (the config's coefficient 0.001), over the response tokens on the shared paths. That
    loss is a product of two means over a forward's tokens (Switch Transformer eq. 4), not a sum over tokens, so it is
    computed per micro-batch, as transformers computes it per forward, and equal updates need micro-batches of the
    same samples: 4 per micro-batch, one prompt's group each, on one process and on each rank (with 3 per
    micro-batch, which groups other samples on two ranks than on one, the MoE updates differed by 7.3e-5 and 7.6e-5,
    the same under FSDP2 and ZeRO-3; Qwen3.5 dense by 2.0e-8). Text Qwen3 (q/k norms) the same on the prompts
    without their images."""
    if arch not in ARCHS:
        pytest.skip(f"transformers without {arch} (5.24 has it)")
    single = single_updates(arch)
    out = tmp_path / f"{arch}-{strategy}.pt"
    _run([str(tiny_model(arch)), str(out), strategy, stage, "shared", *GROUP_MICRO_BATCHES], 2)
    got, ref = torch.load(out)["state"], single["state"]
    initial = load_file(str(tiny_model(arch) / "model.safetensors"))
    assert set(got) == set(ref)
    moved = max((ref[k].double() - initial[k].double()).abs().max().item() for k in ref if k in initial)
    assert moved > 5e-4
    diff = max((got[k].double() - ref[k].double()).abs().max().item() for k in ref)
    assert_within(
        diff, 1e-5, f"{arch} {strategy} zero{stage} shared forward: max |param difference| 2 ranks vs 1 process plain"
    )
