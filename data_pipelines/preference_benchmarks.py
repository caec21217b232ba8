"""Readers for the public multimodal reward-model benchmarks, from a user's local copy, into preference pairs.

Layouts (``LAYOUTS``; ``"auto"`` picks by the first row's fields):

- ``vlrewardbench`` (VL-RewardBench, Li et al. 2024, arXiv 2411.17451; the hub's
  ``MMInstruction/VL-RewardBench``): ``id``, ``query``, ``image``, ``response`` (a list of two),
  ``human_ranking`` (the rank of each response, 0 = best: ``[0, 1]`` means the first is better; equal ranks
  are a tie), ``ground_truth``, ``query_source``. Category: the paper's three (``general``: vlfeedback,
  wildvision; ``hallucination``: povid, rlaif-v, rlhf-v; ``reasoning``: mathverse, mmmu-pro), else the
  source itself; source: ``query_source``.
- ``mmrewardbench`` (Multimodal RewardBench, Yasunaga et al. 2025, arXiv 2502.14191; its
  ``all_data.json``): ``ID``, ``Text``, ``Image``, ``Output1``, ``Output2``, ``Better`` (``Output1`` or
  ``Output2``). Category: ``Category`` when present, else the ``ID`` up to its first ``/`` or ``_``
  (the benchmark's ids start with their subset); source: ``Source`` when present, else the category.
- ``records``: the project's own preference records (``prompt``, ``chosen``, ``rejected``, optional
  ``images``, ``tie``; any file ``read_records(kind="preference")`` reads). Category: ``metadata.category``,
  else the record's ``task``; source: ``metadata.source``, else the task.

Files: JSON (a list, or an object with a ``data``/``rows`` list), JSONL, Parquet or CSV, or a folder of them
(the hub's ``data/test-*.parquet``). Images may be embedded (bytes, a ``{"bytes", "path"}`` dict as a
Parquet export of the hub dataset stores them, a data URI, or plain base64 text) or paths (relative paths
start at the data file's folder, or ``image_root``).

Each benchmark item becomes a :class:`~data_pipelines.records.PreferencePair` (``chosen`` = the better
response) whose ``metadata`` holds ``benchmark``, ``category``, ``source`` and ``first_is_chosen`` (whether
the benchmark lists the better response first: pairwise judges are shown the benchmark's order, then the
swapped one). Images stay as found (paths made absolute, base64 decoded); encoders load them with the
model's own pixel bounds.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

from data_pipelines.errors import DataError
from data_pipelines.readers import SkipReport, collect, read_records, required_text
from data_pipelines.records import PreferencePair
from data_pipelines.sources import open_rows

LAYOUTS = ("vlrewardbench", "mmrewardbench", "records")
# How a predicted tie (equal scores, a "tie" verdict, or no verdict) counts against a decided gold label:
# VL-RewardBench counts only a correct choice (a tie is wrong); Multimodal RewardBench items are scored
# here with half credit for a tie (the expectation of breaking it at random); the project's own records,
# as train-reward-model's held-out accuracy, count r(chosen) > r(rejected) only. Gold ties are skipped.
TIE_CREDIT = {"vlrewardbench": 0.0, "mmrewardbench": 0.5, "records": 0.0}
VLRB_CATEGORIES = {
    "vlfeedback": "general",
    "wildvision": "general",
    "povid": "hallucination",
    "rlaif-v": "hallucination",
    "rlhf-v": "hallucination",
    "mathverse": "reasoning",
    "mmmu-pro": "reasoning",
}


def detect_layout(row: dict[str, Any]) -> str:
    """The layout of a benchmark row by its fields."""
    if "human_ranking" in row and "response" in row:
        return "vlrewardbench"
    if "Output1" in row and "Better" in row:
        return "mmrewardbench"
    if "chosen" in row and "rejected" in row:
        return "records"
    raise DataError(
        f"unknown preference-benchmark layout (fields {sorted(row)[:12]}); expected VL-RewardBench "
        "(query, response, human_ranking), Multimodal RewardBench (Text, Output1, Output2, Better) or "
        "preference records (prompt, chosen, rejected)",
        category="unknown layout",
    )


def benchmark_image(value: Any, base_dir: Path | None) -> Any:
    """An image field as the image loader takes it: paths made absolute, plain base64 text decoded."""
    if isinstance(value, str) and not value.startswith("data:"):
        path = Path(value).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if path.is_file() or len(value) < 64:  # a path (a short string is never a whole image)
            return str(path)
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            return str(path)  # not base64 either: the loader reports the missing file
    return value


def _images(value: Any, base_dir: Path | None) -> list[Any]:
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return [benchmark_image(v, base_dir) for v in items]


def _pair(
    id_: str, prompt: str, first: str, second: str, winner: int | None, images: list, layout: str, cat: str, src: str
) -> PreferencePair:
    """``winner``: 0 (first better), 1 (second better) or None (a gold tie)."""
    first_is_chosen = winner != 1
    chosen, rejected = (first, second) if first_is_chosen else (second, first)
    return PreferencePair(
        id=id_,
        prompt=prompt,
        chosen=chosen,
        rejected=rejected,
        images=images,
        tie=winner is None,
        task=cat,
        metadata={"benchmark": layout, "category": cat, "source": src, "first_is_chosen": first_is_chosen},
    )


def _vlrb(row: dict[str, Any], row_no: Any, base_dir: Path | None) -> PreferencePair:
    responses = row.get("response")
    if not isinstance(responses, (list, tuple)) or len(responses) != 2:
        raise DataError("'response' must be a list of two responses", category="wrong type", field="response")
    ranking = row.get("human_ranking")
    if not isinstance(ranking, (list, tuple)) or len(ranking) != 2:
        raise DataError("'human_ranking' must hold two ranks", category="wrong type", field="human_ranking")
    r0, r1 = (float(r) for r in ranking)
    winner = None if r0 == r1 else (0 if r0 < r1 else 1)
    source = str(row.get("query_source") or "unknown")
    return _pair(
        str(row.get("id", row_no)),
        required_text(row.get("query"), "query"),
        required_text(responses[0], "response[0]"),
        required_text(responses[1], "response[1]"),
        winner,
        _images(row.get("image"), base_dir),
        "vlrewardbench",
        VLRB_CATEGORIES.get(source.lower(), source),
        source,
    )


def _mmrb(row: dict[str, Any], row_no: Any, base_dir: Path | None) -> PreferencePair:
    better = str(row.get("Better", "")).strip()
    if better not in ("Output1", "Output2"):
        raise DataError(f"'Better' must be Output1 or Output2, got {better!r}", category="bad value", field="Better")
    id_ = str(row.get("ID", row_no))
    category = str(row.get("Category") or id_.replace("_", "/").split("/")[0])
    return _pair(
        id_,
        required_text(row.get("Text"), "Text"),
        required_text(row.get("Output1"), "Output1"),
        required_text(row.get("Output2"), "Output2"),
        0 if better == "Output1" else 1,
        _images(row.get("Image"), base_dir),
        "mmrewardbench",
        category,
        str(row.get("Source") or category),
    )


def read_preference_benchmark(
    source: str | Path, layout: str = "auto", *, on_bad_record: str = "error", image_root: str | Path | None = None
) -> tuple[list[PreferencePair], SkipReport, str]:
    """Preference pairs of a benchmark file/folder in ``layout`` (see the module doc); returns the pairs,
    the pass's :class:`SkipReport` and the layout read."""
    if layout not in ("auto", *LAYOUTS):
        raise ValueError(f"layout must be auto or one of {LAYOUTS}, got {layout!r}")
    rows, label, base_dir = open_rows(source)
    base = Path(image_root) if image_root is not None else base_dir
    rows = list(rows)
    if layout == "auto":
        first = next((r for _, r in rows if isinstance(r, dict)), None)
        if first is None:
            raise DataError("no readable rows", category="empty file", source=label)
        layout = detect_layout(first)
    if layout == "records":
        pairs, report = read_records(source, "preference", on_bad_record=on_bad_record, load_images=False)
        for p in pairs:
            p.images = _images(p.images, base)  # relative paths start at the file's folder (or image_root)
            cat = str(p.metadata.get("category") or p.task)
            p.metadata.update(
                benchmark="records", category=cat, source=str(p.metadata.get("source") or p.task), first_is_chosen=True
            )
        return pairs, report, layout
    make = _vlrb if layout == "vlrewardbench" else _mmrb
    pairs, report = collect(
        iter(rows), label, lambda row, row_no, _: make(row, row_no, base), on_bad_record=on_bad_record
    )
    return pairs, report, layout
