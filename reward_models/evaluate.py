"""Accuracy of a trained reward model on held-out records (``vlrft eval-reward-model``).

- SRM (a folder with ``vlrft_reward_head.json``) on preference pairs: pairwise accuracy = share of
  non-tied pairs with ``r(chosen) > r(rejected)``; also the mean reward margin.
- GRM (any other model folder) on judgment records: judgment accuracy = share of records whose greedy
  judgment has the same verdict as the target (:func:`~reward_models.generative.parse_judgment`);
  unparsable judgments count as wrong and are reported.

With no counted item (every pair a tie, no readable target) the accuracy is undefined: None, not 0.
:func:`metrics_json` is the one writer of metrics files (strict JSON, ``null`` for undefined figures).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from data_pipelines import synthetic
from data_pipelines.readers import read_records
from data_pipelines.records import media
from reward_models.generative import generate_judgments, parse_judgment
from reward_models.scalar import HEAD_CONFIG, ScalarRewardModel, score_responses
from vlrft.models.loading import load_model, load_processor
from vlrft.rollout import RolloutConfig, make_engine


def _non_finite(value: Any, key: str) -> list[str]:
    """The keys (``a/b[2]`` paths) of the non-finite floats in a metrics value."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [key]
    if isinstance(value, dict):
        return [bad for k, v in value.items() for bad in _non_finite(v, f"{key}/{k}" if key else str(k))]
    if isinstance(value, (list, tuple)):
        return [bad for i, v in enumerate(value) for bad in _non_finite(v, f"{key}[{i}]")]
    return []


def metrics_json(metrics: dict[str, Any]) -> str:
    """``metrics`` as strict JSON text (RFC 8259: no bare ``NaN``/``Infinity``, which ``json.dumps`` writes by
    default and strict parsers refuse). An undefined figure is None (``null``) where it is computed; a NaN or
    infinity that reaches this writer is a bug, refused naming its key, never written."""
    bad = _non_finite(metrics, "")
    if bad:
        raise ValueError(f"metrics {bad[:5]} are not finite numbers; an undefined figure must be None (null)")
    return json.dumps(metrics, indent=2, allow_nan=False)


def load_eval_records(
    data: str,
    kind: str,
    on_bad_record: str = "error",
    synthetic_options: dict | None = None,
    judge_mode: str = "pointwise",
    synthetic_size: int = 128,
    seed: int = 0,
) -> list:
    """Records from a file/folder, or ``synthetic:TASK``: ``synthetic_size`` held-out records of a run with
    ``train.seed = seed`` (drawn with :func:`~data_pipelines.synthetic.heldout_seed`, as the trainers draw theirs)."""
    task = synthetic.synthetic_task(data)
    if task is not None:
        opts, held = dict(synthetic_options or {}), synthetic.heldout_seed(seed)
        if kind == "preference":
            return synthetic.make_preference_pairs(task, synthetic_size, held, **opts)
        # pointwise: the pool's judge format, as train-reward-model's synthetic data
        return synthetic.make_judgment_records(task, synthetic_size, held, judge_mode=judge_mode, **opts)

    records, report = read_records(data, kind=kind, on_bad_record=on_bad_record)
    if report.skipped:
        print(report.summary())
    return records


def pair_counts(chosen: torch.Tensor, rejected: torch.Tensor, ties: list[bool]) -> dict[str, float]:
    """Sums over preference pairs (``counted`` non-tied pairs, ``correct`` with r(chosen) > r(rejected), their
    ``margin_sum``): summed over ranks, :func:`reward_metrics` turns them into the metrics."""
    keep = torch.tensor([not t for t in ties], dtype=torch.bool)
    chosen, rejected = chosen.float().cpu(), rejected.float().cpu()
    return {
        "correct": float(((chosen > rejected) & keep).sum()),
        "counted": float(keep.sum()),
        "margin_sum": float((chosen - rejected)[keep].sum()),
    }


def judgment_counts(texts: list[str], targets: list[str], judge_mode: str, score_max: float = 1.0) -> dict[str, float]:
    """Sums over judgments: ``counted`` targets with a readable verdict, ``correct`` greedy judgments with
    the same verdict, ``unparsable`` judgments (counted as wrong)."""
    correct = counted = unparsable = 0
    for text, target in zip(texts, targets):
        want = parse_judgment(target, judge_mode, score_max)
        if want is None:
            continue
        got = parse_judgment(text, judge_mode, score_max)
        counted += 1
        correct += int(got == want)
        unparsable += int(got is None)
    return {"correct": float(correct), "counted": float(counted), "unparsable": float(unparsable)}


def reward_metrics(kind: str, counts: dict[str, float]) -> dict[str, Any]:
    """The metrics of an SRM (``pairwise_accuracy``, ``mean_margin``) or a judge (``judgment_accuracy``,
    ``unparsable``) from summed counts; ``n`` the items counted. The one place these names are made: the
    trainer's held-out evaluation and ``vlrft eval-reward-model`` report the same figures."""
    n = int(counts["counted"])
    if kind == "srm":
        margin = counts["margin_sum"] / n if n else None  # undefined without a non-tied pair
        return {"n": n, "pairwise_accuracy": counts["correct"] / max(n, 1), "mean_margin": margin}
    return {"n": n, "judgment_accuracy": counts["correct"] / max(n, 1), "unparsable": counts["unparsable"]}


@torch.no_grad()
def evaluate_reward_model(
    model_dir: str | Path,
    data: str,
    batch_size: int = 16,
    max_new_tokens: int = 24,
    judge_mode: str = "pointwise",
    on_bad_record: str = "error",
    synthetic_options: dict | None = None,
    device: str | None = None,
    synthetic_size: int = 128,
    seed: int = 0,
) -> dict[str, Any]:
    """Metrics of the reward model in ``model_dir`` on ``data`` (see the module doc)."""

    model_dir = Path(model_dir)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if (model_dir / HEAD_CONFIG).is_file():
        pairs = load_eval_records(
            data, "preference", on_bad_record, synthetic_options, synthetic_size=synthetic_size, seed=seed
        )
        model = ScalarRewardModel.from_pretrained(model_dir).to(dev)
        processor = load_processor(str(model_dir))
        items = [(p.prompt, media(p), p.chosen, p.system) for p in pairs]
        items += [(p.prompt, media(p), p.rejected, p.system) for p in pairs]
        rewards = score_responses(model, processor, items, batch_size, device=dev)
        counts = pair_counts(rewards[: len(pairs)], rewards[len(pairs) :], [p.tie for p in pairs])
        return {"kind": "srm", **_undefined_when_empty(reward_metrics("srm", counts), "pairwise_accuracy")}

    records = load_eval_records(
        data, "judgment", on_bad_record, synthetic_options, judge_mode, synthetic_size=synthetic_size, seed=seed
    )
    model, processor = load_model(model_dir, device=dev)
    engine = make_engine(RolloutConfig.on_model(micro_batch_size=batch_size), model, processor)
    texts = generate_judgments(engine, processor, [(r.prompt, media(r), r.system) for r in records], max_new_tokens)
    counts = judgment_counts(texts, [r.target for r in records], judge_mode)
    return {"kind": "grm", **_undefined_when_empty(reward_metrics("grm", counts), "judgment_accuracy")}


def _undefined_when_empty(metrics: dict[str, Any], accuracy: str) -> dict[str, Any]:
    """An accuracy over no counted item is undefined (None), not the 0.0 that ``reward_metrics`` gives the
    trainer's logs (whose trackers take numbers only)."""
    return {**metrics, accuracy: None} if not metrics["n"] else metrics
