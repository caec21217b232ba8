"""`vlrft train-sft` and `vlrft train-dpo`: learning proofs from a random tiny Qwen2.5-VL on the embedded
defaults, `vlrft eval` on their output, LoRA with a frozen vision tower."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import pytest
import torch
from launch import QUIET
from tolerance import assert_within

from data_pipelines.synthetic import make_prompt_records, write_prompt_records
from vlrft.cli import main
from vlrft.config import load_config
from vlrft.models.loading import load_model
from vlrft.strategies import make_strategy
from vlrft.trainer.supervised_config import SFTTrainConfig


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_sft_default_learns_the_colour_task_and_vlrft_eval_agrees(tiny_model, tmp_path, capsys):
    """Learning proof: the embedded default (tiny random Qwen2.5-VL, colour demonstrations) from 0 to >= 0.9
    held-out greedy accuracy; `vlrft eval` on final/ scores the same held-out prompts the same."""
    run = tmp_path / "sft"
    t0 = time.time()
    rc = main(["train-sft", f"model.path={tiny_model('qwen2_5_vl')}", f"train.output_dir={run}", *QUIET])
    elapsed = time.time() - t0
    assert rc == 0
    evals = [r for r in _rows(run) if "eval/accuracy" in r]
    before, after = evals[0], evals[-1]
    out = capsys.readouterr().out
    print(
        f"SFT: held-out accuracy {before['eval/accuracy']:.3f} -> {after['eval/accuracy']:.3f}, nll "
        f"{before['eval/nll']:.2f} -> {after['eval/nll']:.3f} in {after['step']} steps, {elapsed:.0f} s"
    )
    assert "held-out accuracy 0.000 -> " in out  # printed before/after, as train-policy does
    assert before["step"] == 0 and before["eval/accuracy"] <= 0.3
    assert after["step"] == 60 and after["eval/accuracy"] >= 0.9 and after["eval/n"] == 64
    assert after["eval/nll"] < before["eval/nll"] / 10
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "step-000060" / "COMPLETE").is_file()
    # the exported model is a plain transformers checkpoint that `vlrft eval` runs on
    held_out = make_prompt_records("color", 64, seed=10_000, num_colors=4, noise=24)
    data = write_prompt_records(held_out, tmp_path / "held_out.jsonl")
    args = ["eval", "--benchmark", "colors", "--verifier", "vocab_answer", "--model", str(run / "final")]
    args += ["--data", str(data), "--out", str(tmp_path / "eval"), "--max-new-tokens", "8", "--no-progress"]
    assert main(args) == 0
    report = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert report["accuracy"] == pytest.approx(after["eval/accuracy"])


def test_train_dpo_default_raises_preference_and_greedy_accuracy(tiny_model, tmp_path, capsys):
    """Learning proof: DPO from the random tiny model on right-vs-wrong colour answers: held-out preference
    accuracy of the implicit reward from 0 (policy = reference: every margin is 0) to >= 0.9, and the
    greedy answer accuracy up measurably."""
    run = tmp_path / "dpo"
    t0 = time.time()
    rc = main(["train-dpo", f"model.path={tiny_model('qwen2_5_vl')}", f"train.output_dir={run}", *QUIET])
    elapsed = time.time() - t0
    assert rc == 0
    evals = [r for r in _rows(run) if "eval/preference_accuracy" in r]
    before, after = evals[0], evals[-1]
    print(
        f"DPO: held-out preference accuracy {before['eval/preference_accuracy']:.3f} -> "
        f"{after['eval/preference_accuracy']:.3f}, greedy accuracy {before['eval/accuracy']:.3f} -> "
        f"{after['eval/accuracy']:.3f}, in {after['step']} steps, {elapsed:.0f} s"
    )
    assert before["eval/preference_accuracy"] == 0.0 and after["eval/preference_accuracy"] >= 0.9
    assert after["eval/reward_margin"] > 0
    assert after["eval/accuracy"] >= before["eval/accuracy"] + 0.3
    train = [r for r in _rows(run) if "train/rewards/margins" in r]
    assert train[-1]["train/rewards/accuracy"] >= 0.9


def test_lora_with_a_frozen_vision_tower_trains_no_tower_parameter(tiny_model):
    """peft puts LoRA adapters on the vision tower's MLPs too: freezing must come after the wrapping."""
    cfg = load_config(SFTTrainConfig, None, ["strategy.lora_rank=4", "strategy.freeze_vision_tower=true"])
    model, _ = load_model(tiny_model("qwen2_5_vl"))
    strategy = make_strategy(cfg.strategy, cfg.optim)
    strategy.prepare(model)
    trainable = [n for n, p in strategy.unwrap().named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert not [n for n in trainable if ".visual." in n], "LoRA adapters of the frozen vision tower are trainable"
    assert any("language_model" in n or ".layers." in n for n in trainable)


def test_dpo_precomputed_reference_gives_the_same_training(tiny_model, tmp_path):
    """dpo.precompute_ref (a first pass, then the reference is freed) trains exactly as the live reference;
    micro-batches of one pair accumulate to the same update."""
    from safetensors.torch import load_file

    common = [f"model.path={tiny_model('qwen2_5_vl')}", "train.max_steps=2", "train.batch_size=4"]
    # AdamW eps 1e-4 bounds the update's slope in the gradient (see the bound below)
    common += ["data.synthetic_train_size=8", "data.eval_source=''", "optim.eps=1e-4", *QUIET]
    runs = {
        "live": [],
        "precomputed": ["dpo.precompute_ref=true"],
        "micro": ["dpo.precompute_ref=true", "train.micro_batch_size=1"],
    }
    states = {}
    for name, extra in runs.items():
        assert main(["train-dpo", *common, f"train.output_dir={tmp_path / name}", *extra]) == 0
        states[name] = load_file(str(tmp_path / name / "final" / "model.safetensors"))
    # The bound: each AdamW step moves a parameter by lr * m_hat / (sqrt(v_hat) + eps), whose slope in the
    # gradient is at most ~lr / eps = 3e-3 / 1e-4 = 30 (with the usual eps = 1e-8 it is 3e5, and a gradient element
    # that cancels to float32 noise moves by up to lr whichever its last bits: 1.4e-5 on an AVX-512 EPYC). The
    # reference log-probs and the micro-batches change the float32 summation order only, so gradients differ by
    # at most ~1e-6 (~100 ulps of elements up to ~0.1); over two steps the parameters agree within
    # 2 * 30 * 1e-6 = 6e-5.
    for name in ("precomputed", "micro"):
        diff = max((states[name][k].double() - v.double()).abs().max().item() for k, v in states["live"].items())
        assert_within(diff, 6e-5, f"DPO {name} vs live reference: max |param difference| after two AdamW steps")


def test_dpo_reference_log_probs_travel_with_the_checkpoint(tiny_model):
    """A pair's reference log-probs depend on the layout of the batch they are computed in (its neighbours and
    padding change the float32 sums on some CPUs), so they are computed once, where the pair is first met, and kept
    in the checkpoint: a resumed task takes the checkpointed values and never recomputes them in another batch (the
    cause of the DPO resume that was not bitwise on an Intel Xeon: epoch 2 recomputed what epoch 1 had cached)."""
    from vlrft.supervised import batch_indices
    from vlrft.trainer.supervised_config import DPOTrainConfig
    from vlrft.trainer.supervised_run import DPOTask, preference_pairs

    cfg = load_config(DPOTrainConfig, None, [f"model.path={tiny_model('qwen2_5_vl')}"])
    model, processor = load_model(tiny_model("qwen2_5_vl"))
    strategy = make_strategy(cfg.strategy, cfg.optim)
    ref, _, _ = strategy.prepare(model, trainable=False)
    pairs = preference_pairs(cfg.data.train_source, 8, cfg.train.seed, cfg, processor)
    epochs = [[pairs[i] for i in batch_indices(8, step, 4, 0, 1, cfg.train.seed, 1)] for step in range(4)]
    first = DPOTask(processor, cfg, strategy, ref, pairs)
    for batch in epochs[:2]:  # the first epoch computes every pair's reference
        first.reference(batch)
    resumed = DPOTask(processor, cfg, strategy, None, pairs)  # no reference model: nothing may be recomputed
    resumed.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))  # what a checkpoint keeps
    for batch in epochs[2:]:  # the second epoch's batches: the first epoch's values, bitwise
        assert torch.equal(resumed.reference(batch), first.reference(batch))
    assert len(first.state_dict()["ref_logps"]) == 8


def test_both_commands_train_on_user_files(tiny_model, tmp_path):
    """train-sft on a chat JSONL (images by path) with held-out prompt records, train-dpo on a preference-pair
    JSONL: the user-file paths end to end (2 steps each)."""
    from data_pipelines.synthetic import make_preference_pairs
    from data_pipelines.writers import write_records

    records = make_prompt_records("color", 6, seed=3)
    for i, r in enumerate(records):
        r.images[0].save(tmp_path / f"{i}.png")
    chats = tmp_path / "chats.jsonl"
    rows = [
        {"prompt": "<image>What colour?", "response": r.answer, "images": [f"{i}.png"]} for i, r in enumerate(records)
    ]
    chats.write_text("".join(json.dumps(row) + "\n" for row in rows))
    held_out = write_prompt_records(records[:2], tmp_path / "held_out.jsonl")
    common = [f"model.path={tiny_model('qwen2_5_vl')}", "train.max_steps=2", "train.batch_size=2", *QUIET]
    sft = tmp_path / "sft"
    args = [f"data.train_source={chats}", f"data.eval_source={held_out}", f"train.output_dir={sft}"]
    assert main(["train-sft", *common, *args]) == 0
    assert [r["eval/n"] for r in _rows(sft) if "eval/n" in r] == [2.0, 2.0]
    pairs = write_records(make_preference_pairs("color", 4, seed=4), tmp_path / "pairs.jsonl")
    dpo = tmp_path / "dpo"
    args = [f"data.train_source={pairs}", f"data.eval_source={pairs}", f"train.output_dir={dpo}"]
    assert main(["train-dpo", *common, *args]) == 0
    rows = [r for r in _rows(dpo) if "eval/preference_accuracy" in r]
    assert [r["step"] for r in rows] == [0, 2] and rows[0]["eval/preference_accuracy"] == 0.0
    assert (dpo / "final" / "model.safetensors").is_file()
