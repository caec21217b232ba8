"""Reward models on preference benchmarks (``vlrft eval-reward-model MODEL DATA --benchmark LAYOUT``).

Every kind of reward model is reduced to the same number per item, its *preference for the chosen
response* (1, 0, or a tie 0.5; :mod:`reward_models.judgments`):

- SRM: ``score_preference(r(chosen), r(rejected))`` (the score difference's sign);
- pointwise GRM: the same on its two judged scores;
- pairwise GRM: shown the benchmark's order (response 1 as A) and the swapped one; its preference is the
  first order's verdict, or with ``debias="swap"`` the mean of both (``swap_debiased``). Both orders are
  always judged, so the position-bias figures (``position_bias``: consistency, accuracy per order, rate of
  choosing A) come with every pairwise evaluation.

An item's outcome is 1 when the preference is for the chosen response, 0 when for the rejected one, and
the benchmark's tie credit (``data_pipelines.preference_benchmarks.TIE_CREDIT``) for a tie; gold ties are
skipped (counted). Metrics (:func:`benchmark_metrics`): ``accuracy`` with its percentile-bootstrap
``accuracy_ci95`` (``eval.metrics.bootstrap_ci``), ``accuracy/category/C`` and ``accuracy/source/S``,
``macro_accuracy`` (the mean over categories, as VL-RewardBench reports), ``predicted_ties``. The HTML
report (``eval.report``) shows the worst-judged items first with their images.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from data_pipelines.preference_benchmarks import TIE_CREDIT, read_preference_benchmark
from data_pipelines.records import PreferencePair
from eval.metrics import bootstrap_ci
from eval.report import write_report
from reward_models.generative import GenerativeRewardModel
from reward_models.judgments import position_bias, preference, score_preference
from reward_models.pairwise import PairwiseJudge
from reward_models.scalar import HEAD_CONFIG, ScalarRewardModel, score_responses
from vlrft.models.loading import load_processor

REPORT_ITEMS = 50  # worst-judged items in the HTML report


def outcome(pref_chosen: float, tie_credit: float) -> float:
    """1 for a preference for the chosen response, 0 for the rejected one, ``tie_credit`` for a tie."""
    return 1.0 if pref_chosen > 0.5 else 0.0 if pref_chosen < 0.5 else tie_credit


def benchmark_metrics(
    pairs: Sequence[PreferencePair], prefs: Sequence[float], tie_credit: float, seed: int = 0
) -> dict[str, Any]:
    """Accuracy overall, per category and per source, with a bootstrap CI (see the module doc)."""
    keep = [i for i, p in enumerate(pairs) if not p.tie]
    scores = [outcome(prefs[i], tie_credit) for i in keep]
    out: dict[str, Any] = {
        "n": len(keep),
        "gold_ties_skipped": len(pairs) - len(keep),
        "accuracy": float(np.mean(scores)) if scores else float("nan"),
        "accuracy_ci95": list(bootstrap_ci(scores, seed=seed)),
        "predicted_ties": sum(1 for i in keep if prefs[i] == 0.5),
    }
    for field in ("category", "source"):
        groups: dict[str, list[float]] = {}
        for i, s in zip(keep, scores):
            groups.setdefault(str(pairs[i].metadata.get(field, pairs[i].task)), []).append(s)
        for name in sorted(groups):
            out[f"accuracy/{field}/{name}"] = float(np.mean(groups[name]))
            out[f"n/{field}/{name}"] = len(groups[name])
        if field == "category":
            out["macro_accuracy"] = float(np.mean([np.mean(v) for v in groups.values()])) if groups else float("nan")
    return out


def _first_second(p: PreferencePair) -> tuple[str, str]:
    """The pair's responses in the benchmark's own order."""
    return (p.chosen, p.rejected) if p.metadata.get("first_is_chosen", True) else (p.rejected, p.chosen)


def score_pairs(
    model_dir: str | Path,
    pairs: Sequence[PreferencePair],
    *,
    judge_mode: str = "pointwise",
    debias: str = "none",
    batch_size: int = 8,
    max_new_tokens: int = 24,
    device: torch.device | None = None,
) -> tuple[list[float], list[dict[str, Any]], dict[str, Any]]:
    """Preference for the chosen response of each pair, per-item details and kind-specific metrics."""
    dev = device or torch.device("cpu")
    model_dir = Path(model_dir)
    if (model_dir / HEAD_CONFIG).is_file():
        srm = ScalarRewardModel.from_pretrained(model_dir).to(dev).eval()
        items = [(p.prompt, p.images, p.chosen, p.system) for p in pairs]
        items += [(p.prompt, p.images, p.rejected, p.system) for p in pairs]
        with torch.no_grad():
            r = score_responses(srm, load_processor(str(model_dir)), items, batch_size, device=dev).tolist()
        c, w = r[: len(pairs)], r[len(pairs) :]
        details = [{"chosen": f"reward {a:.4f}", "rejected": f"reward {b:.4f}", "margin": a - b} for a, b in zip(c, w)]
        return [score_preference(a, b) for a, b in zip(c, w)], details, {"kind": "srm"}
    grm = GenerativeRewardModel.from_pretrained(model_dir, max_new_tokens=max_new_tokens)
    grm.model.to(dev).eval()
    if judge_mode == "pointwise":
        items = [(p.prompt, p.images, p.chosen, p.system) for p in pairs]
        items += [(p.prompt, p.images, p.rejected, p.system) for p in pairs]
        r, _ = grm.score(items, batch_size)
        c, w = r[: len(pairs)].tolist(), r[len(pairs) :].tolist()
        details = [{"chosen": f"score {a:.3f}", "rejected": f"score {b:.3f}", "margin": a - b} for a, b in zip(c, w)]
        extra = {"kind": "grm-pointwise", "unparsable": grm.parser.n_unparsable}
        return [score_preference(a, b) for a, b in zip(c, w)], details, extra
    judge = PairwiseJudge(grm, debias)
    ordered = [(p.prompt, p.images, *_first_second(p)) for p in pairs]
    ab = [preference(v) for v in judge.verdicts(ordered, batch_size)]  # response 1 shown as A
    ba = [preference(v) for v in judge.verdicts([(q, i, b, a) for q, i, a, b in ordered], batch_size)]
    first_better = [bool(p.metadata.get("first_is_chosen", True)) for p in pairs]
    prefs, details = [], []
    for p_ab, p_ba, f in zip(ab, ba, first_better):
        first = (p_ab + 1.0 - p_ba) / 2 if debias == "swap" else p_ab  # preference for response 1
        prefs.append(first if f else 1.0 - first)
        details.append({"chosen": f"A-first pref {p_ab}", "rejected": f"swapped pref {p_ba}", "margin": prefs[-1]})
    decided = [i for i, p in enumerate(pairs) if not p.tie]
    bias = position_bias([ab[i] for i in decided], [ba[i] for i in decided], [first_better[i] for i in decided])
    extra = {"kind": "grm-pairwise", "debias": debias, "unparsable": judge.n_unparsable, "judgments": judge.n_judged}
    return prefs, details, {**extra, **{f"position_bias/{k}": v for k, v in bias.items()}}


def report_rows(
    pairs: Sequence[PreferencePair], prefs: Sequence[float], details: Sequence[dict[str, Any]], tie_credit: float
) -> list[dict[str, Any]]:
    """Rows of the eval harness's HTML report, worst-judged first (lowest outcome, then lowest margin)."""
    rows = []
    for p, pref, d in zip(pairs, prefs, details):
        if p.tie:
            continue
        got = outcome(pref, tie_credit)
        rows.append(
            {
                "id": p.id,
                "prompt": p.prompt,
                "answer": f"chosen (category {p.metadata.get('category')}, source {p.metadata.get('source')})",
                "num_correct": int(got > 0.5),
                "sort": (got, d["margin"]),
                "responses": [
                    {"text": p.chosen, "extracted": f"chosen: {d['chosen']}", "correct": got > 0.5},
                    {"text": p.rejected, "extracted": f"rejected: {d['rejected']}", "correct": got > 0.5},
                ],
            }
        )
    rows.sort(key=lambda r: r.pop("sort"))
    return rows


def evaluate_benchmark(
    model_dir: str | Path,
    data: str,
    *,
    layout: str = "auto",
    judge_mode: str = "pointwise",
    debias: str = "none",
    batch_size: int = 8,
    max_new_tokens: int = 24,
    on_bad_record: str = "error",
    out_dir: str | Path | None = None,
    device: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Metrics of the reward model in ``model_dir`` on a preference benchmark; with ``out_dir`` also
    ``metrics.json`` and ``report.html`` (worst-judged items first, with their images)."""
    pairs, report, layout = read_preference_benchmark(data, layout, on_bad_record=on_bad_record)
    if not pairs:
        raise ValueError(f"{data}: no benchmark items")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    prefs, details, extra = score_pairs(
        model_dir,
        pairs,
        judge_mode=judge_mode,
        debias=debias,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        device=dev,
    )
    tie_credit = TIE_CREDIT[layout]
    metrics = {
        "benchmark": layout,
        "tie_credit": tie_credit,
        **extra,
        **benchmark_metrics(pairs, prefs, tie_credit, seed),
    }
    metrics["skipped_rows"] = report.skipped
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        rows = report_rows(pairs, prefs, details, tie_credit)[:REPORT_ITEMS]
        write_report(out / "report.html", metrics, rows, pairs, title=f"{layout}: {Path(str(model_dir)).name}")
    return metrics
