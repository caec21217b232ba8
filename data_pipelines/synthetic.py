"""Synthetic verifiable visual tasks as records: offline data for demos and learning proofs. The tasks themselves
(``"color"``, ``"yes_no"``, ``"mark_color"``, ``"shape"``, ``"count_shapes"``, ``"triangle_angle"``) and their options
are in ``data_pipelines.synthetic_tasks``; here they become prompt records, preference pairs and judgments, and a
data source ``synthetic:TASK`` is read.

The same ``(task, n, seed, options)`` gives the same records, pixel for pixel. Labels of the
classification tasks are balanced (each class ``n // k`` or ``n // k + 1`` times, order shuffled).
"""

from __future__ import annotations

import inspect
import random
from pathlib import Path
from typing import Any

from data_pipelines.errors import DataError
from data_pipelines.formatting import (
    JUDGE_SYSTEM_PROMPT,
    POINTWISE_JUDGE_TEMPLATE,
    pairwise_judgment_record,
    pointwise_judgment_record,
)
from data_pipelines.records import JudgmentRecord, PreferencePair, PromptRecord
from data_pipelines.synthetic_tasks import TASKS
from data_pipelines.writers import write_records

SYNTHETIC_PREFIX = "synthetic:"
RECORD_OPTIONS = ("random_answers",)  # make_prompt_records' own keywords, taken by every task
HELDOUT_SEED_OFFSET = 10_000  # held-out synthetic records are drawn with the run's seed + this, by every trainer


def synthetic_task(source: str) -> str | None:
    """``synthetic:TASK`` -> ``TASK`` (a name of :data:`TASKS`); ``None`` for any other source (a file, a folder,
    a hub id). The one spelling of a synthetic source: sizes and options are the data section's own fields."""
    if not source.startswith(SYNTHETIC_PREFIX):
        return None
    task = source[len(SYNTHETIC_PREFIX) :]
    if task not in TASKS:
        raise DataError(
            f"unknown synthetic task {task!r}; write synthetic:TASK with TASK one of {', '.join(TASKS)} "
            "(sizes, seed and options are separate settings)",
            source=source,
            category="unknown synthetic task",
        )
    return task


def check_options(task: str, options: dict[str, Any], extra: tuple[str, ...] = ()) -> None:
    """Refuse ``options`` that ``task`` would refuse once drawing, before anything is drawn or loaded: a keyword
    the task does not take (nor ``extra``, the keywords of the record maker that wraps it), or a value its own
    checks refuse (one record is drawn to find out). Raises ``ValueError`` naming the option and the rule."""
    params = inspect.signature(TASKS[task]).parameters
    known = [name for name, p in params.items() if p.kind is p.KEYWORD_ONLY] + list(RECORD_OPTIONS) + list(extra)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(
            f"synthetic:{task} takes no option {', '.join(map(repr, unknown))}; its options: {', '.join(known)}"
        )
    try:  # the record maker's own checks (random_answers) and the task's, on one record
        make_prompt_records(task, 1, 0, **{k: v for k, v in options.items() if k in params or k in RECORD_OPTIONS})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"synthetic:{task}: {exc}") from None


def heldout_seed(seed: int) -> int:
    """The seed of a run's synthetic held-out records (``seed``: the run's ``train.seed``)."""
    return seed + HELDOUT_SEED_OFFSET


def make_prompt_records(
    task: str, n: int, seed: int = 0, *, random_answers: bool = False, **options: Any
) -> list[PromptRecord]:
    """``n`` prompt records of ``task`` (one RGB PIL image each, exact answer, ``task`` as task label).

    ``metadata`` holds ``ground_truth`` (the answer), ``vocabulary`` (every possible answer) and the
    drawing's facts (colour, angles ...). ``options`` are the task's keywords (see the module doc).

    ``random_answers``: each record's answer is a uniform draw from its vocabulary, independent of the image and
    the question (random labels, as in Zhang et al. 2017, arXiv 1611.03530), and so is everything made from it
    (preference pairs, judgments): data for a format-only warm start, from which a model learns the answer words
    and nothing of which one is right. The true answer stays in ``metadata["true_answer"]``; the same seed gives
    the same draws.
    """
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; known: {sorted(TASKS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not isinstance(random_answers, bool):
        raise ValueError(f"random_answers must be true or false, got {random_answers!r}")
    rng = random.Random(f"vlrft-synthetic/{task}/{seed}")
    samples = TASKS[task](n, rng, **options)
    coin = random.Random(f"vlrft-synthetic/{task}/{seed}/random-answers") if random_answers else None
    records = []
    for i, (im, question, answer, meta) in enumerate(samples):
        facts = {**meta, "seed": seed, "index": i}
        if coin is not None:
            facts["true_answer"], answer = answer, coin.choice(meta["vocabulary"])
        records.append(
            PromptRecord(
                id=f"{task}-{seed}-{i}",
                prompt=question,
                images=[im],
                answer=answer,
                task=task,
                metadata={"ground_truth": answer, **facts},
            )
        )
    return records


def _rationale(rec: PromptRecord, wanted: bool) -> str:
    """A judge's rationale that solves the task before it judges (the reference answer, stated), if ``wanted``."""
    return f"The answer is {rec.answer}." if wanted else ""


def _wrong(rec: PromptRecord, rng: random.Random) -> str:
    return rng.choice([v for v in rec.metadata["vocabulary"] if v != rec.answer])


def make_preference_pairs(
    task: str, n: int, seed: int = 0, *, response_template: str = "{answer}", **options: Any
) -> list[PreferencePair]:
    """``n`` pairs: the right answer (chosen) against a wrong one from the task's vocabulary (rejected).

    ``response_template`` formats both responses (e.g. ``"<answer>{answer}</answer>"``).
    """
    rng = random.Random(f"vlrft-pairs/{task}/{seed}")
    pairs = []
    for rec in make_prompt_records(task, n, seed, **options):
        wrong = _wrong(rec, rng)
        pairs.append(
            PreferencePair(
                id=rec.id,
                prompt=rec.prompt,
                images=rec.images,
                task=task,
                chosen=response_template.format(answer=rec.answer),
                rejected=response_template.format(answer=wrong),
                metadata={**rec.metadata, "wrong_answer": wrong},
            )
        )
    return pairs


def make_judgment_records(
    task: str,
    n: int,
    seed: int = 0,
    *,
    judge_mode: str = "pointwise",
    paired: bool = False,
    judge_template: str = POINTWISE_JUDGE_TEMPLATE,
    judge_system_prompt: str = JUDGE_SYSTEM_PROMPT,
    rationale: bool = False,
    **options: Any,
) -> list[JudgmentRecord]:
    """Judge records from ``task``'s prompts: the image, the question and candidate answer(s); the target
    is the verdict. Wrong candidates are drawn from the task's answer vocabulary.

    ``judge_mode="pointwise"`` (what ``train-reward-model`` trains on): the judge format of
    :func:`~data_pipelines.formatting.pointwise_judgment_record` (the reward pool's; ``judge_template``
    and ``judge_system_prompt`` as its ``judge_template``/``judge_system_prompt``), target
    ``<answer>yes</answer>`` or ``<answer>no</answer>``. ``paired``: ``n // 2`` prompts, each giving its
    right candidate (yes) then a wrong one (no), side by side (train with ``data.group_size: 2``);
    otherwise ``n`` prompts with the right and a wrong candidate alternating.

    ``judge_mode="pairwise"``: the pairwise judge format (:func:`~data_pipelines.formatting.pairwise_judgment_record`)
    with one right and one wrong answer, target ``<answer>A</answer>`` or ``<answer>B</answer>`` (half
    each, shuffled); ``paired``: ``n // 2`` prompts, each giving its pair in both orders side by side (A
    then B: the swap augmentation against position bias; train with ``data.group_size: 2``).

    ``rationale``: the target states the reference answer before the verdict (``The answer is red.
    <answer>A</answer>``): the judge solves the task, then compares, so the verdict is a match of text it wrote
    against the candidates' text instead of the image against them in one token (docs/reward-models.md: the pairwise
    colour judge learns in 4 of 5 seeds with it, 1 of 5 without).
    """
    if judge_mode not in ("pointwise", "pairwise"):
        raise ValueError(f"judge_mode must be 'pointwise' or 'pairwise', got {judge_mode!r}")
    if judge_mode == "pointwise":
        rng = random.Random(f"vlrft-judge/{task}/{seed}")
        out: list[JudgmentRecord] = []
        for i, rec in enumerate(make_prompt_records(task, n // 2 if paired else n, seed, **options)):
            wrong = _wrong(rec, rng)
            right = [True, False] if paired else [i % 2 == 0]
            why = _rationale(rec, rationale)
            out += [
                pointwise_judgment_record(
                    rec, rec.answer if ok else wrong, ok, why, template=judge_template, system=judge_system_prompt
                )
                for ok in right
            ]
        return out
    rng = random.Random(f"vlrft-judgments/{task}/{seed}/pairwise")
    if paired:  # each prompt's pair in both orders, side by side: (right, wrong) -> A, then (wrong, right) -> B
        out = []
        for rec in make_prompt_records(task, n // 2, seed, **options):
            wrong = _wrong(rec, rng)
            why = _rationale(rec, rationale)
            out += [
                pairwise_judgment_record(rec, rec.answer, wrong, "A", rationale=why),
                pairwise_judgment_record(rec, wrong, rec.answer, "B", rationale=why),
            ]
        return out
    flags = [i % 2 == 0 for i in range(n)]
    rng.shuffle(flags)
    out = []
    for rec, flag in zip(make_prompt_records(task, n, seed, **options), flags):
        wrong = _wrong(rec, rng)
        a, b = (rec.answer, wrong) if flag else (wrong, rec.answer)
        why = _rationale(rec, rationale)
        out.append(pairwise_judgment_record(rec, a, b, "A" if flag else "B", rationale=why))
    return out


def write_prompt_records(records: list[Any], out_jsonl: str | Path, image_dir: str | Path | None = None) -> Path:
    """Write records to JSONL with their images as PNG files (``<out stem>_images/`` by default)."""
    return write_records(records, out_jsonl, image_dir=image_dir)
