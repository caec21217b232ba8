"""SFT as RL's cold start, measured: GRPO from a random tiny Qwen2.5-VL vs GRPO after `train-sft`.

On a harder synthetic task (default: name the colour of ONE shape on a grey 56x56 image, 8 colours; the
embedded train-policy demo colours the whole image, 4 colours), three runs from the SAME random
initialisation, each a `vlrft` command in a subprocess, timed:
  A. train-policy from the random model;
  B. train-sft on a small set of demonstrations, then
  C. train-policy with model.path=<B's final model>, the same RL settings as A.
The demonstrations, the RL prompts and the held-out prompts are drawn with the same task options
(``--options``, replacing the embedded train-policy default's colour-task noise).
Writes OUT/cold_start.json (held-out accuracy at every evaluation with the wall-clock time of each run)
and prints a Markdown table for docs/benchmarks.md.
Usage: python scripts/sft_cold_start.py [OUT] [--task color] [--options '{mode: object, num_colors: 8, noise: 0}']
    [--demos 128] [--sft-steps 60] [--rl-steps 100] [--samples 32] [--eval-every 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def vlrft(args: list[str], log: Path) -> float:
    """Run ``python -m vlrft ARGS`` (one thread), output to ``log``; returns its wall-clock seconds."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    t0 = time.time()
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-m", "vlrft", *args], check=True, stdout=f, stderr=subprocess.STDOUT, env=env)
    return time.time() - t0


def evals(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="runs/sft_cold_start")
    ap.add_argument("--task", default="color")
    ap.add_argument(
        "--options",
        default="{mode: object, num_colors: 8, noise: 0}",
        help="synthetic task options (YAML), the same for demonstrations, RL prompts and held-out prompts",
    )
    ap.add_argument("--demos", type=int, default=128)
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--rl-steps", type=int, default=100)
    ap.add_argument("--samples", type=int, default=32, help="GRPO samples per prompt (8 prompts per step)")
    ap.add_argument("--eval-every", type=int, default=20, help="RL steps between held-out evaluations")
    a = ap.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    quiet = ["logging.wandb=disabled", "logging.progress_bar=false", "logging.tensorboard=false"]
    rl = [
        f"data.train_source=synthetic:{a.task}",
        f"data.eval_source=synthetic:{a.task}",
        "data.synthetic_train_size=512",
        "data.synthetic_eval_size=64",
        f"data.synthetic_options={a.options}",
        "rollout.rollout_batch_size=8",
        f"rollout.n_samples_per_prompt={a.samples}",
        "rollout.max_new_tokens=4",
        "train.micro_train_batch_size=64",
        f"train.max_steps={a.rl_steps}",
        f"train.eval_every={a.eval_every}",
        *quiet,
    ]
    init = out / "random" / "initial-model"
    result: dict = {"args": vars(a)}
    done = out / "random.json"  # the baseline is reused when the script is run again with the same RL settings
    cached = json.loads(done.read_text()) if done.is_file() else {}
    if cached.get("rl") == rl:
        result["rl_from_random"] = cached
    else:
        t = vlrft(
            ["train-policy", *rl, f"train.output_dir={out / 'random'}", "train.overwrite=true"], out / "random.log"
        )
        result["rl_from_random"] = {"rl": rl, "seconds": t, "evals": evals(out / "random")}
        done.write_text(json.dumps(result["rl_from_random"]) + "\n")
    print("RL from random:", result["rl_from_random"], flush=True)
    sft = [
        f"model.path={init}",
        f"data.train_source=synthetic:{a.task}",
        f"data.eval_source=synthetic:{a.task}",
        f"data.synthetic_train_size={a.demos}",
        "data.synthetic_eval_size=64",
        f"data.synthetic_options={a.options}",
        f"train.max_steps={a.sft_steps}",
        f"train.eval_every={max(1, a.sft_steps // 3)}",
        f"train.output_dir={out / 'sft'}",
        *quiet,
    ]
    # a CONFIG of its own, so that the embedded demo's colour-task options do not apply
    (out / "sft.yaml").write_text("data:\n  synthetic_options: {}\n")
    t = vlrft(["train-sft", str(out / "sft.yaml"), *sft], out / "sft.log")
    result["sft"] = {"seconds": t, "evals": evals(out / "sft")}
    print("SFT:", result["sft"], flush=True)
    t = vlrft(
        ["train-policy", *rl, f"model.path={out / 'sft' / 'final'}", f"train.output_dir={out / 'rl_after_sft'}"],
        out / "rl_after_sft.log",
    )
    result["rl_after_sft"] = {"seconds": t, "evals": evals(out / "rl_after_sft")}
    (out / "cold_start.json").write_text(json.dumps(result, indent=2) + "\n")
    print("| run | held-out accuracy (at step) | wall-clock |\n|---|---|---|")
    for name, key in (("RL from random", "rl_from_random"), ("SFT (demos)", "sft"), ("RL after SFT", "rl_after_sft")):
        curve = ", ".join(f"{acc:.2f} ({s})" for s, acc in result[key]["evals"])
        print(f"| {name} | {curve} | {result[key]['seconds']:.0f} s |")


if __name__ == "__main__":
    main()
