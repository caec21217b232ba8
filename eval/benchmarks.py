"""Benchmark definitions: where the prompt records come from, how they are prompted, which verifier scores.

A benchmark is data + a prompt template (a name in ``data_pipelines.formatting.PROMPT_TEMPLATES``) + a
rule verifier (a name in ``reward_models.verifiers.VERIFIERS``). Built in: ``gsm8k``,
``gsm8k_flexible``, ``geo3k`` (free-form) and ``geo3k_mc`` (multiple choice). A user benchmark is
prompt records plus a verifier name: :func:`user_benchmark`, or ``vlrft eval --benchmark NAME
--data RECORDS --verifier VERIFIER``. Exact definitions and sources: docs/eval.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from data_pipelines.converters import as_multiple_choice, convert_geo3k, convert_gsm8k
from data_pipelines.readers import read_records
from data_pipelines.records import PromptRecord
from data_pipelines.sources import open_rows
from reward_models.pool import user_verifier
from reward_models.verifiers import VERIFIERS, Verifier
from vlrft.user_code import is_spec

Loader = Callable[[str | Path, str], list[PromptRecord]]


@dataclass(frozen=True)
class Benchmark:
    name: str
    verifier: Any  # a name in reward_models.verifiers.VERIFIERS, or a Verifier object (a reward source's)
    prompt_template: str | None  # a name in PROMPT_TEMPLATES or a format string with {prompt}
    loader: Loader  # (data path or hub id, split) -> prompt records
    source: str = ""  # where the data and the protocol come from
    description: str = ""
    split: str = "test"
    task: str | None = None  # the records' task label (built-in benchmarks); others are refused by vlrft eval

    def load(self, data: str | Path, *, split: str | None = None, limit: int | None = None) -> list[PromptRecord]:
        """The benchmark's prompt records from ``data`` (first ``limit`` of them)."""
        records = self.loader(data, split or self.split)
        return records[:limit] if limit is not None else records


def _first_row(data: str | Path, split: str) -> dict:

    rows, _, _ = open_rows(data, split=split)
    for _, row in rows:
        return row if isinstance(row, dict) else {}
    return {}


def read_prompt_records(data: str | Path, split: str = "test") -> list[PromptRecord]:
    """Prompt records as written by ``vlrft prepare-data`` (or any source ``read_records`` reads), their ids
    unique (the runner scores and resumes by id)."""

    records, _ = read_records(data, "prompt", split=split, load_images=False, unique_ids=True)
    path = Path(data)
    base = path.parent if path.is_file() else path
    for r in records:  # relative image paths start at the records file's folder
        r.images = [str(base / im) if isinstance(im, str) and _is_relative_path(im) else im for im in r.images]
    return records


def _is_relative_path(s: str) -> bool:
    return not (s.startswith(("data:", "file://", "http://", "https://")) or Path(s).is_absolute())


def load_gsm8k(data: str | Path, split: str = "test") -> list[PromptRecord]:
    """GSM8K from the OpenAI layout (``question``/``answer``), the hub layout, or prepared records."""

    if "question" in _first_row(data, split):
        return convert_gsm8k(data, split)[0]
    return read_prompt_records(data, split)


def load_geo3k(data: str | Path, split: str = "test") -> list[PromptRecord]:
    """Geometry3K (free-form) from the InterGPS folder layout, the hub layout, or prepared records."""

    path = Path(data)
    folder = path / split if (path / split).is_dir() else path
    if (folder.is_dir() and any(folder.glob("*/data.json"))) or "problem" in _first_row(data, split):
        return convert_geo3k(data, split)[0]
    return read_prompt_records(data, split)


def load_geo3k_mc(data: str | Path, split: str = "test") -> list[PromptRecord]:
    return [as_multiple_choice(r) for r in load_geo3k(data, split)]


GSM8K_SOURCE = (
    "Cobbe et al. 2021, Training Verifiers to Solve Math Word Problems, arXiv 2110.14168 "
    "(github.com/openai/grade-school-math); extraction as lm-evaluation-harness's gsm8k "
    "strict-match / flexible-extract; instruction as verl's GSM8K example"
)
GEO3K_SOURCE = (
    "Lu et al. 2021, Inter-GPS, ACL 2021, arXiv 2105.04165 (Geometry3K); free-form protocol "
    "of the hub copy hiyouga/geometry3k and EasyR1's math prompt; equivalence by math-verify"
)

BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            "gsm8k",
            "gsm8k",
            "gsm8k",
            load_gsm8k,
            GSM8K_SOURCE,
            "grade-school maths; the number after the last ####, else the last \\boxed{}",
            task="gsm8k",
        ),
        Benchmark(
            "gsm8k_flexible",
            "gsm8k_flexible",
            "gsm8k",
            load_gsm8k,
            GSM8K_SOURCE,
            "as gsm8k, falling back to the last number in the response",
            task="gsm8k",
        ),
        Benchmark(
            "geo3k",
            "math_boxed",
            "math_boxed",
            load_geo3k,
            GEO3K_SOURCE,
            "geometry diagrams; the last \\boxed{} checked against the right choice's text",
            task="geo3k",
        ),
        Benchmark(
            "geo3k_mc",
            "multiple_choice",
            "math_boxed",
            load_geo3k_mc,
            GEO3K_SOURCE,
            "geometry diagrams with the four choices shown; the boxed letter scored",
            task="geo3k",
        ),
    )
}


def user_benchmark(
    name: str, verifier: Any, prompt_template: str | None = "plain", *, split: str = "test", description: str = ""
) -> Benchmark:
    """A benchmark over prompt records (any source ``read_records`` reads) scored by ``verifier``."""

    if not isinstance(verifier, Verifier) and verifier not in VERIFIERS:
        raise ValueError(f"benchmark {name!r}: unknown verifier {verifier!r}; known: {', '.join(sorted(VERIFIERS))}")
    return Benchmark(name, verifier, prompt_template, read_prompt_records, "user prompt records", description, split)


def get_benchmark(
    name: str | Benchmark, *, verifier: str | None = None, prompt_template: str | None = None
) -> Benchmark:
    """A built-in benchmark by name (``verifier``/``prompt_template`` override its own), or a user
    benchmark when ``name`` is not built in and ``verifier`` is given: a registered verifier's name, or the
    user's reward function ``path/to/file.py:name`` (``reward_models.pool.user_verifier``)."""
    if isinstance(name, Benchmark):
        return name
    if isinstance(verifier, str) and is_spec(verifier):  # the user's own function: path/to/file.py:name
        verifier = user_verifier(verifier)
    if name in BENCHMARKS:
        bench = BENCHMARKS[name]
        if verifier is not None:
            bench = replace(bench, verifier=verifier)
        if prompt_template is not None:
            bench = replace(bench, prompt_template=prompt_template)
        return bench
    if verifier is None:
        raise ValueError(
            f"unknown benchmark {name!r}: built in are {', '.join(BENCHMARKS)}; for your own "
            "prompt records also name a verifier (--verifier)"
        )
    return user_benchmark(name, verifier, prompt_template or "plain")
