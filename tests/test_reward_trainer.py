"""`vlrft train-reward-model`: learning proofs (SRM, GRM), torchrun with FSDP2/DeepSpeed, exact resume."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from launch import kill_when, run_job, subprocess_env, torchrun
from tolerance import assert_within

from reward_models.scalar import ScalarRewardModel
from vlrft.cli import main

REPO = Path(__file__).resolve().parents[1]
QUIET = ["logging.wandb=disabled", "logging.progress_bar=false"]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _torchrun(args: list[str], port_offset: int = 0) -> list[str]:
    return torchrun("-m", "vlrft", "train-reward-model", *args, port_offset=port_offset)


def _state(model_dir: Path) -> dict[str, torch.Tensor]:
    return ScalarRewardModel.from_pretrained(model_dir).state_dict()


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_srm_learns_colour_preferences_and_eval_command_agrees(tiny_model, tmp_path, capsys):
    """Learning proof: a tiny Qwen2.5-VL SRM from scratch, 2-colour pairs, >= 90% held-out accuracy."""
    run = tmp_path / "srm"
    t0 = time.time()
    rc = main(
        [
            "train-reward-model",
            str(REPO / "configs/reward_model/srm_color.yaml"),
            f"model.path={tiny_model('qwen2_5_vl')}",
            f"train.output_dir={run}",
            "data.synthetic_train_size=256",
            "data.synthetic_eval_size=64",
            "train.max_steps=40",
            "train.save_every=0",
        ]
    )
    elapsed = time.time() - t0
    assert rc == 0
    rows = [r for r in _metrics(run) if "eval/pairwise_accuracy" in r]
    first, last = rows[0], rows[-1]
    print(
        f"SRM: held-out pairwise accuracy {first['eval/pairwise_accuracy']:.3f} -> "
        f"{last['eval/pairwise_accuracy']:.3f} "
        f"in {last['step']} steps, {elapsed:.0f} s"
    )
    assert first["step"] == 0 and 0.3 <= first["eval/pairwise_accuracy"] <= 0.7  # about chance before training
    assert last["step"] == 40 and last["eval/pairwise_accuracy"] >= 0.9 and last["eval/n"] == 64
    assert (run / "config.yaml").is_file() and any((run / "tensorboard").iterdir())
    assert list((run / "wandb").glob("offline-run-*"))  # wandb writes offline by default
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000040"]
    # the exported model reloads without training state and scores the same held-out set the same way
    capsys.readouterr()
    rc = main(
        [
            "eval-reward-model",
            str(run / "final"),
            "synthetic:color",  # the held-out set of a run with train.seed 0
            "--synthetic-size",
            "64",
            "--synthetic-option",
            "num_colors=2",
            "--out",
            str(tmp_path / "eval.json"),
        ]
    )
    assert rc == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["kind"] == "srm" and report["n"] == 64
    assert report["pairwise_accuracy"] == pytest.approx(last["eval/pairwise_accuracy"])
    assert report["mean_margin"] > 0


def test_grm_learns_colour_judgments_and_eval_command_agrees(tiny_model, tmp_path, capsys):
    """Learning proof: a tiny Qwen2.5-VL judge from scratch, >= 80% held-out judgment accuracy."""
    from data_pipelines.synthetic import heldout_seed, make_judgment_records
    from data_pipelines.writers import write_records

    run = tmp_path / "grm"
    t0 = time.time()
    rc = main(
        [
            "train-reward-model",
            str(REPO / "configs/reward_model/grm_color.yaml"),
            f"model.path={tiny_model('qwen2_5_vl')}",
            f"train.output_dir={run}",
            "train.save_every=0",
            *QUIET,
        ]
    )
    elapsed = time.time() - t0
    assert rc == 0
    rows = [r for r in _metrics(run) if "eval/judgment_accuracy" in r]
    final = rows[-1]
    print(
        f"GRM: held-out judgment accuracy {rows[0]['eval/judgment_accuracy']:.3f} -> "
        f"{final['eval/judgment_accuracy']:.3f} in {final['step']} steps, {elapsed:.0f} s"
    )
    assert rows[0]["eval/judgment_accuracy"] <= 0.6  # an untrained judge does not even write the format
    assert final["step"] == 400 and final["eval/judgment_accuracy"] >= 0.8 and final["eval/n"] == 64
    # the exported judge, on the same held-out records read back from a JSONL file
    held_out = make_judgment_records("color", 64, seed=heldout_seed(0), num_colors=2)  # the run's held-out set
    data = write_records(held_out, tmp_path / "held_out.jsonl")
    capsys.readouterr()
    assert main(["eval-reward-model", str(run / "final"), str(data), "--out", str(tmp_path / "eval.json")]) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["kind"] == "grm" and report["n"] == 64
    assert report["judgment_accuracy"] == pytest.approx(final["eval/judgment_accuracy"])


def _dist_args(model: Path, out: Path, strategy: str, steps: int = 3, save_every: int = 0) -> list[str]:
    return [
        f"model.path={model}",
        f"train.output_dir={out}",
        f"train.max_steps={steps}",
        "train.batch_size=2",
        "data.synthetic_train_size=16",
        "data.synthetic_eval_size=8",
        "data.synthetic_options={num_colors: 2}",
        "train.eval_every=0",
        f"train.save_every={save_every}",
        "train.log_every=1",
        "optim.lr=1e-3",
        # Adam turns rounding-level gradients (reduction order differs across ranks) into lr-sized steps
        # when eps is tiny; eps 1e-4 keeps the comparison about the strategies, not about that.
        "optim.eps=1e-4",
        f"strategy.name={strategy}",
        "logging.tensorboard=false",
        *QUIET,
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp2", "deepspeed"])
def test_torchrun_two_ranks_match_one_process(tiny_model, tmp_path, strategy):
    """2 gloo ranks x 2 pairs each give the same model as one process with 4 pairs per step."""
    model = tiny_model("qwen2_5_vl")
    single = tmp_path / "single"
    args = _dist_args(model, single, "single")
    assert main(["train-reward-model", *[a for a in args if a != "train.batch_size=2"], "train.batch_size=4"]) == 0
    out = tmp_path / strategy
    res = run_job(_torchrun(_dist_args(model, out, strategy)), env=subprocess_env(), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    # The bound: with eps = 1e-4 each AdamW step's slope in the gradient is at most ~lr / eps = 10; the ranks sum
    # the same float32 gradients in another order and batch layout (differences <= ~1e-6, ~100 ulps of elements
    # up to ~0.1): over 3 steps 3 * 10 * 1e-6 = 3e-5.
    diff = _max_diff(_state(out / "final"), _state(single / "final"))
    assert_within(diff, 3e-5, f"reward model {strategy}: max |2 ranks - 1 process| after 3 AdamW steps")
    dist_rows, single_rows = _metrics(out), _metrics(single)
    losses = [r["train/loss"] for r in dist_rows if "train/loss" in r]
    # losses of ~0.7 from parameters that agree within 3e-5 (a loss's slope in them is well below 0.3)
    single_losses = [r["train/loss"] for r in single_rows if "train/loss" in r]
    assert len(losses) == len(single_losses) == 3
    worst = max(abs(a - b) for a, b in zip(losses, single_losses))
    assert_within(worst, 1e-5, f"reward model {strategy}: train/loss 2 ranks vs 1 process")
    assert json.loads((out / "summary.json").read_text())["eval_after"]["n"] == 8


@pytest.mark.distributed
@pytest.mark.parametrize("strategy, stage", [("fsdp2", 2), ("deepspeed", 3)])
def test_torchrun_grm_trains_and_judges(tiny_model, tmp_path, strategy, stage):
    """A judge under FSDP2 / ZeRO-3 (parameters sharded): SFT steps, held-out judgments, export."""
    from vlrft.models.loading import load_model

    out = tmp_path / strategy
    args = _dist_args(tiny_model("qwen2_5_vl"), out, strategy, steps=2) + [
        "model.kind=grm",
        f"strategy.zero_stage={stage}",
        "data.synthetic_eval_size=5",
        "judge.max_new_tokens=6",
    ]
    res = run_job(_torchrun(args, 3), env=subprocess_env(), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    final = json.loads((out / "summary.json").read_text())["eval_after"]
    assert final["n"] == 5 and final["unparsable"] == 5  # 2 steps at lr 1e-3: no verdicts yet
    rows = [r for r in _metrics(out) if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["train/loss"] < rows[0]["train/loss"]
    model, _ = load_model(out / "final")
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"


@pytest.mark.distributed
def test_killed_torchrun_run_resumes_exactly(tiny_model, tmp_path):
    """FSDP2 under torchrun, killed (SIGKILL) after its step-4 checkpoint, resumes to the same model."""
    model = tiny_model("qwen2_5_vl")
    ref = tmp_path / "ref"
    res = run_job(_torchrun(_dist_args(model, ref, "fsdp2", steps=8, save_every=2)), env=subprocess_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-6000:]
    run = tmp_path / "killed"
    # a slower run (one eval per step) so that the kill lands before the end
    args = _dist_args(model, run, "fsdp2", steps=8, save_every=2) + ["train.eval_every=1"]
    proc = subprocess.Popen(
        _torchrun(args, 1),
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    ckpt = run / "checkpoints" / "step-000004" / "COMPLETE"
    kill_when(proc, ckpt, poll=0.05)
    assert ckpt.exists() and not (run / "final").exists(), "the run must be killed between step 4 and its end"
    res = run_job(_torchrun(args, 2), env=subprocess_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-6000:]
    assert "resumed from" in res.stdout + res.stderr
    # the resumed run repeats the same arithmetic on the same machine: expected 0 (bitwise); 1e-6 is far below
    # what a wrong resume (a lost or repeated step, ~lr = 1e-3 per parameter) gives
    assert_within(_max_diff(_state(run / "final"), _state(ref / "final")), 1e-6, "SIGKILL-resumed vs uninterrupted")
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == ["step-000006", "step-000008"]  # keep_last=2


def test_preference_file_with_a_bad_row_is_refused_by_line_or_skipped_and_counted(tiny_model, tmp_path, capsys):
    """train-reward-model on a real JSONL file: a row without `rejected` stops the run naming file and
    line, or, with data.on_bad_record=skip, is counted and the run trains on the rest."""
    from data_pipelines.synthetic import make_preference_pairs
    from data_pipelines.writers import write_records

    data = write_records(make_preference_pairs("color", 12, seed=4, num_colors=2), tmp_path / "prefs.jsonl")
    lines = data.read_text().splitlines()
    bad = json.loads(lines[2])
    del bad["rejected"]
    lines[2] = json.dumps(bad)
    data.write_text("\n".join(lines) + "\n")
    args = [
        "train-reward-model",
        f"model.path={tiny_model('qwen2_5_vl')}",
        f"data.train_source={data}",
        "data.eval_source=''",  # held out: data.eval_fraction of the file
        "data.eval_fraction=0.25",
        "train.max_steps=2",
        "train.batch_size=2",
        "optim.lr=1e-3",
        "logging.tensorboard=false",
        *QUIET,
    ]
    assert main(args + [f"train.output_dir={tmp_path / 'error'}"]) == 2  # a known failure: one line, exit code 2
    err = capsys.readouterr().err
    assert re.search(r"^vlrft train-reward-model: data error: .*prefs\.jsonl:3 field 'rejected'", err, re.M)
    assert "Traceback" not in err and not (tmp_path / "error").exists()  # refused before anything was built
    assert main(args + [f"train.output_dir={tmp_path / 'skip'}", "data.on_bad_record=skip"]) == 0
    out = capsys.readouterr().out
    assert "kept 11, skipped 1" in out and "8 train / 3 held-out records" in out


def test_reward_model_config_errors_name_the_key():
    from reward_models.config import RewardModelTrainConfig
    from vlrft.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="multiple of data.group_size"):
        load_config(RewardModelTrainConfig, None, ["data.group_size=2", "train.batch_size=3"])
    with pytest.raises(ConfigError, match="did you mean 'tie_mode'"):
        load_config(RewardModelTrainConfig, None, ["loss.tie_mod=half"])
    with pytest.raises(ConfigError, match="model.kind"):
        load_config(RewardModelTrainConfig, None, ["model.kind=prm"])
    for name in ("srm_color", "grm_color", "srm_preferences"):  # the shipped configs load
        load_config(RewardModelTrainConfig, REPO / "configs" / "reward_model" / f"{name}.yaml")
