"""The end of a run (rank 0): ``summary.json``, ``curves.png`` and the closing console lines that say what
changed and where everything is; the same for every trainer (``vlrft.loop``)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any


def write_summary(
    out: Path, summary: dict[str, Any], history: list[dict[str, float]], curve_keys: tuple[str, ...]
) -> None:
    """Write ``summary.json`` and ``curves.png`` into the run folder ``out`` and print where things are. Called after
    the model is saved in ``final/``, so nothing here stops the run: a ``metrics.jsonl`` line that is not a JSON row
    is skipped (counted in one warning naming the file and its lines), a plot that fails is a warning."""
    summary_path = out / "summary.json"
    summary_path.write_text(summary_json(summary))
    evals = [(h["step"], h["eval/accuracy"]) for h in read_metrics(out / "metrics.jsonl") if "eval/accuracy" in h]
    try:
        plot_curves(history, evals, curve_keys, out / "curves.png")
    except Exception as exc:  # noqa: BLE001 - a plot is a convenience; the model and summary.json are written
        print(f"warning: {out / 'curves.png'} not written: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    before, after = summary["eval_before"] or {}, summary["eval_after"] or {}
    lines = [f"\n{summary['command']} done: {summary['steps']} steps."]
    for key, value in after.items():
        shown = "accuracy" in key or "nll" in key or "margin" in key or key.startswith("pass@")
        if shown and isinstance(value, (int, float)):
            was = f"{_fmt(before[key])} -> " if key in before else ""
            lines.append(f"  held-out {key} {was}{_fmt(value)}")
    lines.append(f"  run folder: {out}\n  final model (transformers format): {summary['final_model']}")
    best = summary.get("best")
    if best:
        lines.append(
            f"  best model: {best['path']} (held-out {best['metric']} {_fmt(best['value'])} at step {best['step']})"
        )
    for r in summary.get("rollbacks") or []:
        lines.append(
            f"  rolled back at step {r['at_step']} to step {r['to_step']} (a collapse from step {r['collapse_from']})"
        )
    lines.append(f"  curves: {out / 'curves.png'}")
    if (out / "samples.jsonl").is_file():
        lines.append(f"  sampled trajectories: {out / 'samples.jsonl'}")
    lines.append(f"  metrics: {out / 'metrics.jsonl'} (TensorBoard: {out / 'tensorboard'}, wandb: {out / 'wandb'})")
    print("\n".join(lines), flush=True)


def plot_curves(
    history: list[dict[str, float]], evals: list[tuple[int, float]], keys: tuple[str, ...], path: Path
) -> None:
    """PNG of the training curves (``keys``) and the held-out accuracy, beside the policy entropy if logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for key in keys:
        if any(key in h for h in history):
            axes[0].plot(steps, [h.get(key, float("nan")) for h in history], label=key)
    if evals:
        axes[0].plot([e[0] for e in evals], [e[1] for e in evals], "o-", label="held-out accuracy")
    axes[0].set_xlabel("step")
    axes[0].legend(fontsize=8)
    axes[0].set_title("training and held-out")
    if any("entropy" in h for h in history):
        axes[1].plot(steps, [h.get("entropy", float("nan")) for h in history], label="entropy")
        axes[1].legend(fontsize=8)
    axes[1].set_xlabel("step")
    axes[1].set_title("policy entropy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary_json(summary: dict[str, Any]) -> str:
    """``summary.json``'s text (strict JSON: an undefined figure is ``null``), in the run folder and in ``final/``."""
    return json.dumps(finite(summary), indent=2, allow_nan=False, default=str) + "\n"


def finite(x: Any) -> Any:
    """``x`` with NaN and infinities as ``null`` (strict JSON: an undefined figure is reported as undefined)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def _fmt(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def read_metrics(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` that are JSON objects with a numeric ``step``; any other non-blank line (a
    write cut off by a kill, an edit, a disk that filled) is skipped, and one warning on stderr names the file, how
    many lines and which (the first five)."""
    if not path.is_file():
        return []
    rows, bad = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
        else:
            bad.append(number)
    if bad:
        where = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        print(
            f"warning: {path}: skipped {len(bad)} line(s) that are not JSON metric rows with a step (line {where})",
            file=sys.stderr,
            flush=True,
        )
    return rows
