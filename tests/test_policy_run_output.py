"""What a policy run prints: the last progress line shows the final evaluation the summary reports, and a
single-process run prints no third-party noise (transformers' cache deprecation, DeepSpeed's accelerator)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from launch import run_job, subprocess_env

from data_pipelines.synthetic import make_prompt_records
from reward_models.pool import RewardPool
from vlrft.config import load_config
from vlrft.loop import training_run
from vlrft.models.loading import load_model
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.heldout import heldout_eval
from vlrft.trainer.policy_trainer import PolicyTrainer

SHORT_RUN = [
    "rollout.rollout_batch_size=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_new_tokens=4",
    "data.synthetic_train_size=8",
    "data.synthetic_eval_size=4",
    "logging.tensorboard=false",
    "logging.wandb=disabled",
    "logging.log_every_s=0",
]


def test_the_last_progress_line_shows_the_final_evaluation(tiny_model, tmp_path):
    overrides = [*SHORT_RUN, "train.max_steps=3", "train.eval_every=2", f"train.output_dir={tmp_path / 'run'}"]
    cfg = load_config(PolicyTrainConfig, None, overrides)
    model, processor = load_model(str(tiny_model("qwen2_5_vl")))

    def evaluate(trainer: PolicyTrainer) -> dict[str, float]:  # held-out metrics, and which step they are of
        return {**heldout_eval(trainer), "of_step": float(trainer.steps_done)}

    log = tmp_path / "stderr.log"
    with open(log, "w") as stream:  # stderr to a file: plain progress lines
        saved, sys.stderr = sys.stderr, stream
        try:
            with training_run(cfg, "train-policy") as run:
                trainer = PolicyTrainer(
                    cfg,
                    run.strategy,
                    model,
                    processor,
                    make_prompt_records("color", 8, seed=0),
                    RewardPool(cfg.reward),
                    eval_records=make_prompt_records("color", 4, seed=1),
                    accuracy=("accuracy", "vocab_answer"),
                    evaluate_fn=evaluate,
                    total_steps=3,
                    guard=run.guard,
                )
                trainer.console_keys = ("eval/",)
                result = run.fit(trainer, processor, 3)
        finally:
            sys.stderr = saved
    last = [line for line in log.read_text().splitlines() if line.startswith("train-policy step")][-1]
    assert last.startswith("train-policy step 3/3")  # the export's own progress bars may follow
    shown = dict(item.split("=") for item in last.split(": ", 1)[1].split(", "))
    assert result["eval_after"]["of_step"] == 3.0 and shown["eval/of_step"] == "3"  # not step 2's evaluation
    assert shown["eval/accuracy"] == f"{result['eval_after']['accuracy']:.4g}"
    evals = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if "eval/of_step" in r] == [0, 2, 3]  # the last step evaluated once


def test_a_single_process_run_prints_no_third_party_noise(tiny_model, tmp_path):
    out = tmp_path / "run"
    args = [*SHORT_RUN, "train.max_steps=1", f"model.path={tiny_model('qwen2_5_vl')}", f"train.output_dir={out}"]
    res = run_job(
        [sys.executable, "-m", "vlrft", "train-policy", *args],
        env=subprocess_env(),
        cwd=Path(__file__).resolve().parents[1],
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    assert "Setting accelerator" not in res.stdout + res.stderr  # DeepSpeed's CPU fallback notice
    assert "past_key_values" not in res.stderr and "Warning" not in res.stderr, res.stderr
    assert "\ntrain-policy done: 1 steps." in res.stdout
    summary = json.loads((out / "summary.json").read_text())
    shown = dict(item.split("=") for item in res.stderr.strip().splitlines()[-1].split(": ", 1)[1].split(", "))
    assert shown["eval/accuracy"] == f"{summary['eval_after']['accuracy']:.4g}"


def test_runs_without_deepspeed_never_import_it(tiny_model, tmp_path):
    """A single-process policy run and an SFT run, export included, leave DeepSpeed unimported (accelerate's
    unwrap inside save_pretrained would import it only to ask whether the model is a DeepSpeed engine)."""
    model = tiny_model("qwen2_5_vl")
    runs = [
        ["train-policy", *SHORT_RUN, "train.max_steps=1", f"train.output_dir={tmp_path / 'p'}"],
        ["train-sft", "data.synthetic_train_size=8", "data.synthetic_eval_size=4", "train.max_steps=1"]
        + [f"train.output_dir={tmp_path / 's'}", "logging.wandb=disabled", "logging.tensorboard=false"],
    ]
    code = (
        "import sys; from vlrft.cli import main\n"
        f"for args in {runs!r}:\n    assert main([*args, 'model.path={model}']) == 0\n"
        "print('DEEPSPEED', 'deepspeed' in sys.modules)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "DEEPSPEED False" in res.stdout and "Setting accelerator" not in res.stdout + res.stderr
