"""Rollout routing replay in train-policy (``rollout.routing_replay``, issue 60 item 5): the hf engine's rollouts carry
the experts their tokens were routed to, and the trainer's forwards of a mixture-of-experts policy replay them. The
mechanism itself (recording, bitwise replay, the router's gradient) is tests/test_routing_replay.py; here the wiring:
each rollout's experts are those the engine's own forward chose at its positions, the experience's micro-batches
replay them, a run logs how many routings the trainer's router would have flipped, and replay shrinks the engine vs
trainer log-prob gap on the same samples. The options a dense model or another engine cannot honour are refused in
one line."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from launch import QUIET, run_job, subprocess_env, torchrun
from safetensors.torch import load_file

from data_pipelines.collate import collate_sequences, encode_prompt
from data_pipelines.records import PromptRecord
from vlrft.archs import ARCHS
from vlrft.cli import main
from vlrft.models.loading import load_model
from vlrft.models.moe import moe_blocks
from vlrft.models.routing_replay import NOT_RECORDED, collate_routing, record_routing, replaying
from vlrft.rollout import RolloutConfig, SamplingParams, make_engine
from vlrft.rollout.hf import HFEngineConfig
from vlrft.trainer.experience import Experience, response_logprobs, response_tensors

pytestmark = pytest.mark.skipif("qwen3_vl_moe" not in ARCHS, reason="transformers without Qwen3-VL-MoE (5.24 has it)")


def _scaled_moe(tiny_model, tmp_path, arch: str = "qwen3_vl_moe"):
    """The tiny MoE with its experts' outputs scaled 8x (as in tests/test_routing_replay.py: at initialisation an
    expert's output is small next to the residual stream, so which expert a token reached would barely move its
    log-prob, unlike in a trained MoE), saved as a model folder."""
    folder = tmp_path / f"{arch}-x8"
    shutil.copytree(tiny_model(arch), folder)
    model, _ = load_model(folder, processor=False)
    with torch.no_grad():
        for block in moe_blocks(model):
            block.experts.down_proj.mul_(8.0)
    model.save_pretrained(folder)
    return folder


def test_each_rollout_carries_the_experts_of_its_own_positions_and_the_micro_batch_replays_them(tiny_model, tmp_path):
    """The hf engine with routing replay on (prefill once per prompt, then its samples): each rollout's ``routing``
    ``[prompt + response, L, k]`` holds, at every position but the last response token's, the experts a plain forward
    of that one sequence routes it to (the same float32 weights: no near tie here flips between the two layouts),
    and the last position none; collated into the experience and cut into micro-batches, the trainer's forward
    replays exactly them."""
    folder = tiny_model("qwen3_vl_moe")
    model, proc = load_model(folder)
    model.eval()
    recs = [PromptRecord(id="a", prompt="How many apples are there?"), PromptRecord(id="b", prompt="Name a colour.")]
    prompts = [encode_prompt(proc, r) for r in recs]
    rollout = RolloutConfig(routing_replay=True, hf=HFEngineConfig(inference_copy="off", compile="off"))
    engine = make_engine(rollout, model, proc)
    torch.manual_seed(0)
    with torch.no_grad():
        rollouts = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=6))
    assert len(rollouts) == 6 and all(x.routing is not None for x in rollouts)
    layers, k = len(moe_blocks(model)), model.config.text_config.num_experts_per_tok
    for x in rollouts:
        ids = torch.cat([prompts[x.prompt_index].input_ids, x.response_ids])[None]
        assert x.routing.shape == (ids.shape[1], layers, k) and x.routing.dtype == torch.int16
        with torch.no_grad(), record_routing(model) as record:
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        own = record.take()[0]  # [positions, L, k]
        assert torch.equal(x.routing[:-1].sort(-1).values, own[:-1].sort(-1).values)
        assert (x.routing[-1] == NOT_RECORDED).all()

    pad = proc.tokenizer.pad_token_id
    index = [x.prompt_index for x in rollouts]
    batch = collate_sequences(prompts, index, [x.response_ids for x in rollouts], pad)
    batch["routing"] = collate_routing([x.routing for x in rollouts], batch["input_ids"].shape[1])
    ids, mask = response_tensors([x.response_ids for x in rollouts], pad)
    n = len(rollouts)
    exp = Experience(batch, ids, mask, None, None, torch.zeros(n), torch.zeros(ids.shape), torch.zeros(n))
    mb = exp.micro_batch(torch.tensor([4, 1]))
    assert mb["routing"].shape[:2] == mb["input_ids"].shape
    with torch.no_grad(), record_routing(model) as used, replaying(model, mb) as count:
        response_logprobs(model, mb, mb["response_ids"])
    seen = mb["routing"][..., 0, 0] != NOT_RECORDED
    assert torch.equal(used.take()[seen], mb["routing"][seen].short())
    assert count.routed == int(seen.sum()) * layers and count.flipped == 0


def _run(folder, out, *extra: str) -> list[dict]:
    rc = main(
        ["train-policy", f"model.path={folder}", f"train.output_dir={out}", *QUIET]
        + ["data.synthetic_train_size=8", "data.synthetic_eval_size=4", "train.max_steps=1", "train.eval_every=0"]
        + ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8"]
        + ["rollout.hf.inference_copy=on", "rollout.hf.dtype=bfloat16", "train.log_samples=16", *extra]
    )
    assert rc == 0
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_policy_with_replay_logs_the_flips_and_closes_the_bf16_rollouts_logprob_gap(tiny_model, tmp_path):
    """train-policy on the (experts x8) tiny Qwen3-VL-MoE, rolled out by a bfloat16 inference copy and trained in
    float32: without replay some tokens reach other experts in the trainer than in the rollout; with
    ``rollout.routing_replay=true`` the step's samples are the same (the recording only reads the routers) and the
    update's forward routes them as the rollout did: ``moe/replay_flip_share`` > 0 counts the routings replay
    changed, and the largest engine-vs-trainer log-prob gap (``rollout/logprob_diff_max``) falls. Both runs have the
    engine report its log-probs the same way (``rollout.first_token_temperature`` = the temperature: the sampler
    that reports them, drawing from the same distribution)."""
    folder = _scaled_moe(tiny_model, tmp_path)
    same = ["rollout.first_token_temperature=1.0"]
    plain = _run(folder, tmp_path / "plain", *same)
    replay = _run(folder, tmp_path / "replay", *same, "rollout.routing_replay=true")
    samples = [
        [json.loads(x)["response"] for x in (tmp_path / run / "samples.jsonl").read_text().splitlines()]
        for run in ("plain", "replay")
    ]
    assert samples[0] == samples[1] and len(samples[0]) == 16
    step = [next(r for r in rows if r.get("step") == 1 and "rollout/logprob_diff_max" in r) for rows in (plain, replay)]
    gap_plain, gap_replay = step[0]["rollout/logprob_diff_max"], step[1]["rollout/logprob_diff_max"]
    flips = step[1]["moe/replay_flip_share"]
    print(f"\nbf16 rollout, float32 trainer: flipped routings {flips:.4f}; max |log-prob gap| ", end="")
    print(f"{gap_plain:.4g} without replay, {gap_replay:.4g} with")
    assert "moe/replay_flip_share" not in step[0]
    assert flips > 0 and gap_replay < gap_plain / 2


@pytest.mark.slow  # two torchrun jobs
@pytest.mark.distributed
def test_replay_under_fsdp2_on_two_ranks_closes_the_bf16_rollouts_logprob_gap(tiny_model, tmp_path):
    """The same two runs as above under torchrun, FSDP2 on two gloo ranks: each rank's bf16 inference copy records
    its rollouts' experts, the sharded float32 update replays them; the samples of the two runs are the same,
    replay flips routings and shrinks the largest engine-vs-trainer log-prob gap."""
    folder = _scaled_moe(tiny_model, tmp_path)
    common = [f"model.path={folder}", "strategy.name=fsdp2", *QUIET, "rollout.first_token_temperature=1.0"]
    common += ["data.synthetic_train_size=8", "data.synthetic_eval_size=4", "train.max_steps=1", "train.eval_every=0"]
    common += ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8"]
    common += ["rollout.hf.inference_copy=on", "rollout.hf.dtype=bfloat16", "train.log_samples=16"]
    rows, samples = {}, {}
    for name, extra in (("plain", []), ("replay", ["rollout.routing_replay=true"])):
        out = tmp_path / name
        cmd = torchrun("-m", "vlrft", "train-policy", *common, f"train.output_dir={out}", *extra)
        res = run_job(cmd, env=subprocess_env(), timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
        rows[name] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        samples[name] = sorted(json.loads(x)["response"] for x in (out / "samples.jsonl").read_text().splitlines())
    assert samples["plain"] == samples["replay"] and len(samples["plain"]) >= 8  # the samples rank 0 logs
    step = {k: next(r for r in v if r.get("step") == 1 and "rollout/logprob_diff_max" in r) for k, v in rows.items()}
    gap_plain, gap_replay = step["plain"]["rollout/logprob_diff_max"], step["replay"]["rollout/logprob_diff_max"]
    flips = step["replay"]["moe/replay_flip_share"]
    print(
        f"\nFSDP2, 2 ranks: flipped routings {flips:.4f}; max |log-prob gap| {gap_plain:.4g} without replay, ", end=""
    )
    print(f"{gap_replay:.4g} with")
    assert "moe/replay_flip_share" not in step["plain"]
    assert flips > 0 and gap_replay < gap_plain / 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.engine=vllm"], "rollout.routing_replay=true: the hf engine records the experts its MoE layers"),
        (["tools.names=[zoom]"], "rollout.routing_replay=true: not with tools (a multi-turn trajectory's"),
        (["rollout.hf.compile=on"], "rollout.hf.compile=on: the compiled static-cache decode does not run the"),
    ],
    ids=["vllm", "tools", "compile"],
)
def test_what_routing_replay_cannot_do_is_refused_in_one_line(overrides, message, tiny_model, tmp_path, capsys):
    folder = tiny_model("qwen3_vl_moe")
    run = [
        "train-policy",
        f"model.path={folder}",
        f"train.output_dir={tmp_path / 'run'}",
        "rollout.routing_replay=true",
    ]
    assert main([*run, *QUIET, *overrides]) == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith("vlrft train-policy: config error: " + message), line


def test_routing_replay_on_a_dense_model_is_a_config_error(tiny_model, tmp_path, capsys):
    run = ["train-policy", f"model.path={tiny_model('qwen2_5_vl')}", f"train.output_dir={tmp_path / 'run'}"]
    assert main([*run, "rollout.routing_replay=true", *QUIET]) == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line == (
        "vlrft train-policy: config error: rollout.routing_replay=true: qwen2_5_vl is a dense model (no experts to "
        "replay); use routing_replay=false"
    ), line


@pytest.mark.slow
@pytest.mark.distributed
def test_lockstep_async_with_replay_equals_the_colocated_run_with_replay(tiny_model, tmp_path):
    """``rollout.mode=async`` with ``max_staleness: 0`` (one rollout and one trainer rank, 2 gloo processes) and routing
    replay on the tiny Qwen3-VL-MoE: the experts travel with the samples from the rollout rank, and the run ends with
    the weights of the colocated single-process run with replay and keyed sampling, bitwise (the bound 1e-6 is
    issue 59's lockstep bound); both replayed (``moe/replay_flip_share`` logged every step)."""
    folder = tiny_model("qwen3_vl_moe")
    common = [
        f"model.path={folder}",
        "rollout.routing_replay=true",
        "train.max_steps=3",
        "train.eval_every=0",
        "data.synthetic_train_size=16",
        "data.synthetic_eval_size=4",
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=6",
        *QUIET,
    ]
    runs = {
        "sync": ["-m", "vlrft", "train-policy", "rollout.keyed_sampling=true", *common],
        "lock": ["-m", "vlrft", "train-policy", "rollout.mode=async", "rollout.asynchronous.max_staleness=0", *common],
    }
    for name, args in runs.items():
        out = tmp_path / name
        cmd = [sys.executable, *args] if name == "sync" else torchrun(*args, nproc=2, port_offset=71)
        res = run_job([*cmd, f"train.output_dir={out}"], env=subprocess_env(), timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    a, b = (load_file(tmp_path / name / "final" / "model.safetensors") for name in runs)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6 and diff == 0.0, diff
    rows = {n: [json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in runs}
    flips = {n: [r["moe/replay_flip_share"] for r in rows[n] if "moe/replay_flip_share" in r] for n in runs}
    assert len(flips["sync"]) == 3 and flips["sync"] == flips["lock"], flips
