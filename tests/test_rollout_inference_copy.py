"""The hf engine's inference copy (``rollout.hf.inference_copy``): it samples as the training model does, before
and after real updates, in one process and with FSDP2 / ZeRO-3 on 2 gloo ranks (where it also ends the lockstep
generation); ``auto`` leaves one CPU process as it was."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from launch import run_job, subprocess_env, torchrun
from tolerance import assert_within

from vlrft.archs import ARCHS
from vlrft.models.loading import load_model
from vlrft.rollout import HFEngineConfig, SamplingParams, make_engine
from vlrft.strategies import OptimConfig, StrategyConfig, make_strategy

SCRIPT = Path(__file__).parent / "dist" / "inference_copy.py"
sys.path.insert(0, str(SCRIPT.parent))
from vllm_sync import make_prompts, raise_likelihood, trainer_logprobs  # noqa: E402


def test_auto_keeps_one_cpu_process_on_the_training_module_and_copies_for_sharded(tiny_model):
    model, proc = load_model(tiny_model("qwen2_5_vl"))
    auto = HFEngineConfig()
    assert make_engine("hf", model, proc, hf=auto).copy is None  # one CPU process: the numbers stay as they were
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert auto.wants_copy(True, cpu) and not auto.wants_copy(False, cpu) and auto.wants_copy(False, cuda)
    copied = make_engine("hf", model, proc, synced=True, hf=auto)
    assert copied.copy is not None and copied.model is copied.copy and not copied.synced and copied.prefill_once
    assert all(not p.requires_grad for p in copied.copy.parameters())
    assert HFEngineConfig(dtype="bfloat16").copy_dtype(model.dtype, cpu) is torch.bfloat16
    assert auto.copy_dtype(model.dtype, cpu) is torch.float32 and auto.copy_dtype(model.dtype, cuda) is torch.bfloat16


@pytest.mark.distributed
@pytest.mark.parametrize(
    "strategy, arch",
    [("single", "qwen2_5_vl"), ("fsdp2", "qwen2_5_vl"), ("deepspeed", "qwen2_5_vl")]
    + [("single", arch) for arch in ("qwen3_5", "qwen3_5_moe", "qwen3_vl_moe") if arch in ARCHS],
)
def test_the_copy_samples_as_the_training_model_before_and_after_updates(tiny_model, tmp_path, strategy, arch):
    """Greedy tokens identical; the log-probs of the copy's sampled tokens under the copy and under the
    training module agree (float32) before two AdamW steps and after the copy is refreshed from the weight
    stream; between the steps and the refresh the copy is stale (what the check would catch). Also on the new
    architectures (hybrid linear attention, experts: issue 60, item 2), in one process."""
    out = tmp_path / "copy"
    args = [str(SCRIPT), str(tiny_model(arch)), str(out), strategy]
    cmd = [sys.executable, *args] if strategy == "single" else torchrun(*args, nproc=2)
    res = run_job(cmd, env=subprocess_env(), timeout=840)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    ranks = sorted(tmp_path.glob("copy.*"))
    assert len(ranks) == (1 if strategy == "single" else 2)
    for rank_file in ranks:
        r = json.loads(rank_file.read_text())
        print(strategy, rank_file.name, r)
        assert r["copy"] and not r["copy_lockstep"] and r["policy_lockstep"] == (strategy != "single")
        for when in ("before", "after"):
            assert r[when]["greedy_equal"] and r[when]["greedy_tokens"] >= 4 * 4, (when, r[when])
            # the same float32 model in another module (and, sharded, another forward: gathered shards, packed
            # vs padded layout): a few ulps of log-probs of ~7 through ~10 reordered sums, ~1e-6 at worst
            assert_within(r[when]["logprob_gap"], 1e-5, f"{strategy} {rank_file.name} {when}: copy vs policy log-probs")
        assert r["stale"]["logprob_gap"] > 1e-3, r["stale"]  # two AdamW steps at lr 5e-3 moved the policy


def test_a_bfloat16_copy_holds_the_policy_rounded_and_samples_its_distribution(tiny_model):
    """``rollout.hf.dtype=bfloat16`` (the GPU default; on a CPU by choice): the copy holds every policy weight
    rounded to bfloat16, exactly, at the start and after the weight stream refreshes it following two AdamW steps;
    its sampled tokens' log-probs under the float32 policy are those of the copy within bfloat16's rounding."""
    strategy = make_strategy(StrategyConfig(name="single", grad_clip=0), OptimConfig(lr=5e-3))
    model, processor = load_model(tiny_model("qwen2_5_vl"), "float32")
    strategy.prepare(model, total_steps=2)
    engine = make_engine("hf", model, processor, hf=HFEngineConfig(inference_copy="on", dtype="bfloat16"))

    def rounded_equal() -> bool:
        policy = dict(model.named_parameters())
        return all(torch.equal(p, policy[k].detach().to(torch.bfloat16)) for k, p in engine.copy.named_parameters())

    assert {p.dtype for p in engine.copy.parameters()} == {torch.bfloat16} and rounded_equal()
    prompts = make_prompts(processor, "one_image", seed=3)
    torch.manual_seed(11)
    rollouts = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8))
    assert all(len(r.response_ids) > 0 for r in rollouts)
    model.train()
    raise_likelihood(strategy, processor, prompts, rollouts)  # two AdamW steps: the policy moves
    model.eval()
    assert not rounded_equal()  # stale until the stream refreshes it
    engine.update_weights(strategy.full_params(trainable_only=not engine.needs_all_params))
    assert rounded_equal()
    torch.manual_seed(12)
    sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8))
    with torch.no_grad():
        policy, mask = trainer_logprobs(model, processor, prompts, sampled, 1.0, suppress=engine.suppress)
        copy, _ = trainer_logprobs(engine.model, processor, prompts, sampled, 1.0, suppress=engine.suppress)
    gap = float((policy - copy.float()).abs()[mask.bool()].max())
    print(f"bf16 copy vs float32 policy: largest log-prob gap {gap:.3g} over {int(mask.sum())} tokens")
    # bfloat16 keeps 8 significant bits: each weight and activation rounded by up to 2^-9 relative; through the two
    # tiny layers the logits (|z| ~ 1) move by a few 1e-3 and a log-prob by about twice that; 0.1 leaves room for
    # many such roundings adding up and is still far below a stale copy's effect (two AdamW steps move it by > 0.5)
    assert_within(gap, 0.1, "bf16 copy vs float32 policy: log-probs of the copy's samples")


def test_sleep_level_2_drops_the_copy_and_the_stream_restores_every_weight(tiny_model):
    """``rollout.hf.sleep_level=2``: sleep frees the copy's weights (on any device), wake makes room, and the weight
    stream, which then carries frozen parameters too (a frozen vision tower here), writes every one back: after two
    AdamW steps the copy holds the policy's weights bit for bit and samples its greedy tokens. A stream that leaves
    one out is an error, never a copy that generates from unwritten memory."""
    strategy = make_strategy(StrategyConfig(name="single", grad_clip=0), OptimConfig(lr=5e-3))
    model, processor = load_model(tiny_model("qwen2_5_vl"), "float32")
    frozen = [n for n, p in model.named_parameters() if n.startswith("model.visual.")]
    assert frozen
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    strategy.prepare(model, total_steps=2)
    hf = HFEngineConfig(inference_copy="on", sleep_level=2)
    engine = make_engine("hf", model, processor, hf=hf)
    assert engine.needs_all_params and not make_engine("hf", model, processor, hf=HFEngineConfig()).needs_all_params
    prompts = make_prompts(processor, "one_image", seed=3)
    torch.manual_seed(11)
    rollouts = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8))
    engine.sleep()
    assert sum(p.numel() for p in engine.copy.parameters()) == 0  # every weight dropped
    model.train()
    raise_likelihood(strategy, processor, prompts, rollouts)  # two AdamW steps: the policy moves
    model.eval()
    engine.wake()
    engine.update_weights(strategy.full_params(trainable_only=not engine.needs_all_params))
    policy = dict(model.named_parameters())
    assert all(torch.equal(p, policy[k]) for k, p in engine.copy.named_parameters())
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    plain = make_engine("hf", model, processor)
    tokens = [r.response_ids.tolist() for r in engine.generate(prompts, greedy)]
    assert tokens == [r.response_ids.tolist() for r in plain.generate(prompts, greedy)]
    assert sum(map(len, tokens)) >= 4 * len(prompts)

    engine.sleep()
    engine.wake()
    with pytest.raises(RuntimeError, match=r"sleep_level=2 dropped \d+ weights the weight stream did not re-send"):
        engine.update_weights(strategy.full_params(trainable_only=True))  # the frozen tower left out


def test_sleep_levels_0_and_1_leave_a_cpu_copy_in_place(tiny_model):
    """On a CPU there is nowhere to move the copy to: levels 0 and 1 keep its weights where they are."""
    model, processor = load_model(tiny_model("qwen2_5_vl"), "float32")
    for level in (0, 1):
        engine = make_engine("hf", model, processor, hf=HFEngineConfig(inference_copy="on", sleep_level=level))
        before = {k: (p.data_ptr(), p.clone()) for k, p in engine.copy.named_parameters()}
        engine.sleep()
        engine.wake()
        assert not engine.needs_all_params
        assert all(
            p.data_ptr() == before[k][0] and torch.equal(p, before[k][1]) for k, p in engine.copy.named_parameters()
        )


def test_the_host_buffers_of_sleep_level_1_hold_every_weight_once_and_are_reused(tiny_model, monkeypatch):
    """``sleep_level=1`` on a GPU keeps the copy's weights in CPU buffers (page-locked there), made at the first
    sleep and reused: here on CPU, unpinned, with weights of two dtypes (a bfloat16 vision tower) so each view's
    alignment matters, and buffers of 64 KiB so the copy spans many (the embedding, 256 KiB, gets one of its own).
    Offload points every weight into the buffers, restore gives each its own memory again, bit for bit, and a later
    offload writes the weights' new values into the same buffers."""
    from vlrft.rollout.inference_copy import HostCopy as _HostCopy

    monkeypatch.setattr(_HostCopy, "CHUNK", 1 << 16)
    model, _ = load_model(tiny_model("qwen2_5_vl"), "float32")
    model.model.visual.to(torch.bfloat16)
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32, torch.bfloat16}
    values = {k: p.detach().clone() for k, p in params.items()}
    host = _HostCopy(params, pin=False)
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    held = sum(b.numel() for b in host.buffers)
    assert len(host.buffers) > 2 and weight_bytes <= held < weight_bytes + _HostCopy.ALIGN * len(params)
    big = [v.numel() * v.element_size() for v in values.values() if v.numel() * v.element_size() > 1 << 16]
    # a weight over 64 KiB starts a buffer of its own power of two, which later weights may fill: one such per weight
    over = sorted(b.numel() for b in host.buffers if b.numel() > 1 << 16)
    caps = sorted(1 << (n - 1).bit_length() for n in big)
    assert big and len(over) == len(big) and all(n <= cap for n, cap in zip(over, caps))
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in host.views.values())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no two weights share a byte
    assert all(any(b.data_ptr() <= s and e <= b.data_ptr() + b.numel() for b in host.buffers) for s, e in spans)
    assert not host.holds(params)
    host.offload(params)
    assert host.holds(params) and all(torch.equal(p, values[k]) for k, p in params.items())
    assert all(p.data_ptr() % _HostCopy.ALIGN == 0 for p in params.values())
    host.restore(params, torch.device("cpu"))
    assert not host.holds(params)
    assert all(not s <= p.data_ptr() < e for p in params.values() for s, e in spans)  # their own memory again
    assert all(torch.equal(p, values[k]) and p.dtype == values[k].dtype for k, p in params.items())
    with torch.no_grad():
        for p in params.values():
            p.add_(1)
    buffers = [b.data_ptr() for b in host.buffers]
    host.offload(params)
    assert [b.data_ptr() for b in host.buffers] == buffers
    assert all(torch.equal(host.views[k], values[k] + 1) for k in params)


def test_host_layout_packs_weights_into_power_of_two_buffers():
    """Hand-packed: buffers of 256 bytes, offsets of 64. 10 and 100 bytes share the first buffer (at 0 and 64), 200
    does not fit its rest and starts the second, 300 is larger than a buffer and gets one of 512, which the last
    byte shares. torch rounds each page-locked allocation up to a power of two: 256 + 256 + 512 bytes, against 1024
    for one buffer of the 704 used (and 2**31 against 2**30 + 1 in general)."""
    from vlrft.rollout.inference_copy import host_layout as _host_layout

    places, used = _host_layout([10, 100, 200, 300, 1], chunk=256, align=64)
    assert places == [(0, 0), (0, 64), (1, 0), (2, 0), (2, 320)] and used == [192, 256, 384]
    assert _host_layout([0, 64, 256], chunk=256, align=64) == ([(0, 0), (0, 0), (1, 0)], [64, 256])


def test_generating_between_a_level_2_wake_and_the_weight_stream_is_an_error(tiny_model):
    """After ``sleep_level=2`` the woken copy's memory is unwritten until ``update_weights``: generating from it
    would sample from garbage, so it raises instead."""
    model, processor = load_model(tiny_model("qwen2_5_vl"), "float32")
    engine = make_engine("hf", model, processor, hf=HFEngineConfig(inference_copy="on", sleep_level=2))
    prompts = make_prompts(processor, "one_image", seed=3)
    engine.sleep()
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=4)
    with pytest.raises(RuntimeError, match=r"generate after rollout.hf.sleep_level=2 dropped \d+ weights"):
        engine.generate(prompts, greedy)
    engine.update_weights(model.named_parameters())
    plain = make_engine("hf", model, processor)
    tokens = [r.response_ids.tolist() for r in engine.generate(prompts, greedy)]
    assert tokens == [r.response_ids.tolist() for r in plain.generate(prompts, greedy)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sleep_level=1 moves the copy off a GPU (a no-op on CPU)")
def test_sleep_level_1_frees_the_gpu_copy_into_pinned_memory_and_wakes_it_bit_for_bit(tiny_model):
    model, processor = load_model(tiny_model("qwen2_5_vl"), "float32", device="cuda")
    engine = make_engine("hf", model, processor, hf=HFEngineConfig(inference_copy="on", sleep_level=1))
    prompts = make_prompts(processor, "one_image", seed=3)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    tokens = [r.response_ids.tolist() for r in engine.generate(prompts, greedy)]
    values = {k: p.detach().clone() for k, p in engine.copy.named_parameters()}
    copy_bytes = sum(p.numel() * p.element_size() for p in engine.copy.parameters())
    for _ in range(2):  # the second sleep reuses the first one's buffer
        allocated = torch.cuda.memory_allocated()
        engine.sleep()
        assert allocated - torch.cuda.memory_allocated() >= copy_bytes  # the copy's GPU memory is free
        assert all(b.is_pinned() for b in engine._host.buffers) and all(
            p.device.type == "cpu" for p in engine.copy.parameters()
        )
        buffers = [b.data_ptr() for b in engine._host.buffers]
        engine.wake()
        assert all(p.device.type == "cuda" and torch.equal(p, values[k]) for k, p in engine.copy.named_parameters())
    assert [b.data_ptr() for b in engine._host.buffers] == buffers
    assert [r.response_ids.tolist() for r in engine.generate(prompts, greedy)] == tokens
