"""Time one GRPO step of vlrft and of TRL's GRPOTrainer side by side, in one process, alternating.

Both train the same tiny, randomly initialised Qwen2.5-VL (same initial weights) on the same synthetic
colour prompts with the same group size, response length, temperature, learning rate, token-mean loss
and no KL (TRL: beta=0, loss_type="dapo", scale_rewards="group"; vlrft: the GRPO recipe with
loss_agg_mode=token-mean, kl_coef=0). Blocks of steps alternate between the two so that machine noise
hits both; the first block of each is warm-up and not counted. Prints per-step times and the ratio.

    .venv/bin/pip install "trl>=1.16"     # TRL is not a dependency of vlrft
    .venv/bin/python scripts/bench_grpo_step.py --prompts 4 --generations 4 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402


def vlrft_trainer(model_dir: Path, out: Path, a: argparse.Namespace):
    from data_pipelines.synthetic import make_prompt_records
    from reward_models.pool import RewardPool
    from vlrft.config import load_config
    from vlrft.models.loading import load_model
    from vlrft.strategies import make_strategy
    from vlrft.trainer.config import PolicyTrainConfig
    from vlrft.trainer.policy_trainer import PolicyTrainer

    cfg = load_config(
        PolicyTrainConfig,
        None,
        [
            f"rollout.rollout_batch_size={a.prompts}",
            f"rollout.n_samples_per_prompt={a.generations}",
            f"rollout.max_new_tokens={a.max_new_tokens}",
            f"rollout.micro_rollout_batch_size={a.prompts}",
            f"train.micro_train_batch_size={a.prompts * a.generations}",
            "algorithm.loss_agg_mode=token-mean",
            "algorithm.kl_coef=0",
            f"optim.lr={a.lr}",
            f"train.output_dir={out}",
            "train.max_steps=0",
            "train.log_samples=0",
            "strategy.grad_clip=1.0",
        ],
    )
    strategy = make_strategy(cfg.strategy, cfg.optim)
    model, proc = load_model(str(model_dir))
    pool = RewardPool(cfg.reward)
    records = make_prompt_records("color", 512, seed=0)
    trainer = PolicyTrainer(cfg, strategy, model, proc, records, pool, accuracy=("accuracy", "vocab_answer"))
    trainer.total_steps = 0

    def run(steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            metrics: dict = {}
            exp = trainer.make_experience(metrics)
            trainer.train_on(exp, metrics)
            trainer.engine.update_weights(trainer.strategy.full_params())
            trainer.step += 1
            times.append(time.perf_counter() - t0)
        return times

    return run


def trl_trainer(model_dir: Path, out: Path, a: argparse.Namespace):
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import vlrft.models  # noqa: F401
    from data_pipelines.synthetic import make_prompt_records
    from reward_models.verifiers import get_verifier

    records = make_prompt_records("color", 512, seed=0)
    rows = [
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r.prompt}]}],
            "image": r.images[0],
            "answer": r.answer,
            "vocabulary": r.metadata["vocabulary"],
        }
        for r in records
    ]
    dataset = Dataset.from_list(rows)
    verifier = get_verifier("vocab_answer")

    def accuracy(completions, answer, vocabulary, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [verifier(t, g, vocabulary=v).score for t, g, v in zip(texts, answer, vocabulary)]

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    processor = AutoProcessor.from_pretrained(model_dir, padding_side="left")
    state = {"done": 0}

    def run(steps: int) -> list[float]:
        times.clear()
        args = GRPOConfig(
            output_dir=str(out),
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            per_device_train_batch_size=a.prompts * a.generations,
            num_generations=a.generations,
            max_completion_length=a.max_new_tokens,
            temperature=1.0,
            learning_rate=a.lr,
            beta=0.0,
            loss_type="dapo",
            scale_rewards="group",
            num_iterations=1,
            gradient_checkpointing=False,
            max_steps=steps,
            logging_steps=10**6,
            seed=state["done"],
            disable_tqdm=True,
            max_grad_norm=1.0,
            lr_scheduler_type="constant",
            warmup_steps=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[accuracy],
            args=args,
            train_dataset=dataset,
            processing_class=processor,
            callbacks=[Clock()],
        )
        trainer.train()
        state["done"] += steps
        return list(times)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--block", type=int, default=5, help="steps per alternating block")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds counted (after one warm-up round)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from vlrft.models.tiny import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    model_dir = make_tiny_model(tmp / "model", arch="qwen2_5_vl", seed=0)
    runners = {"vlrft": vlrft_trainer(model_dir, tmp / "vlrft", a), "trl": trl_trainer(model_dir, tmp / "trl", a)}
    times: dict[str, list[float]] = {k: [] for k in runners}
    for rnd in range(a.rounds + 1):
        for name, run in runners.items():
            t = run(a.block)
            if rnd > 0:
                times[name] += t
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, "
        f"threads {a.threads}"
    )
    print(
        f"settings: tiny Qwen2.5-VL (random), {a.prompts} prompts x {a.generations} generations, "
        f"{a.max_new_tokens} new tokens, no KL, token-mean loss, {a.rounds} x {a.block} steps each, alternating"
    )
    for k, v in times.items():
        print(
            f"{k:>6}: median {med[k] * 1000:.0f} ms/step (mean {statistics.mean(v) * 1000:.0f}, "
            f"min {min(v) * 1000:.0f}, max {max(v) * 1000:.0f}, n={len(v)})"
        )
    print(f"ratio trl / vlrft (median step time): {med['trl'] / med['vlrft']:.2f}x")


if __name__ == "__main__":
    main()
