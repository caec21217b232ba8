"""The end of a ``train-policy`` run (rank 0): ``summary.json``, ``curves.png`` and the closing console
lines that say where everything is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_summary(out: Path, summary: dict[str, Any], history: list[dict[str, float]]) -> None:
    """Write ``summary.json`` and ``curves.png`` into the run folder ``out`` and print where things are."""
    evals = [(h["step"], h["eval/accuracy"]) for h in _read_metrics(out) if "eval/accuracy" in h]
    plot_curves(history, evals, out / "curves.png")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    before = (summary["eval_before"] or {}).get("accuracy")
    after = (summary["eval_after"] or {}).get("accuracy")
    print(
        f"\ntrain-policy done: {summary['steps']} steps. Held-out accuracy {_fmt(before)} -> {_fmt(after)}\n"
        f"  run folder: {out}\n  final model (transformers format): {summary['final_model']}\n"
        f"  curves: {out / 'curves.png'}\n  sampled trajectories: {out / 'samples.jsonl'}\n"
        f"  metrics: {out / 'metrics.jsonl'} (TensorBoard: {out / 'tensorboard'}, wandb: {out / 'wandb'})",
        flush=True,
    )


def plot_curves(history: list[dict[str, float]], evals: list[tuple[int, float]], path: Path) -> None:
    """PNG of the training reward, accuracy and entropy curves and the held-out accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for key in ("reward/combined", "accuracy", "frac_reward_zero_std"):
        if any(key in h for h in history):
            axes[0].plot(steps, [h.get(key, float("nan")) for h in history], label=key)
    if evals:
        axes[0].plot([e[0] for e in evals], [e[1] for e in evals], "o-", label="held-out accuracy")
    axes[0].set_xlabel("step")
    axes[0].legend(fontsize=8)
    axes[0].set_title("reward and accuracy")
    if any("entropy" in h for h in history):
        axes[1].plot(steps, [h.get("entropy", float("nan")) for h in history], label="entropy")
    axes[1].set_xlabel("step")
    axes[1].legend(fontsize=8)
    axes[1].set_title("policy entropy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _read_metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
