"""The evaluation runner: generate, score with the benchmark's verifier, write samples, metrics and a report.

``evaluate(model, processor_or_tokenizer, records, benchmark, ...)`` is the one entry point, used by
``vlrft eval`` and by the policy trainer every N steps (it returns the metrics dict; with ``out_dir``
it also writes ``samples.jsonl``, ``metrics.json`` and ``report.html`` there).

Resuming: each batch's scored problems are appended to ``samples.jsonl`` in one write as soon as the
batch finishes; a run started again on the same ``out_dir`` skips the ids already there. Batches are
cut from the record list by position and sampling is seeded per batch (``seed + batch index``), so a
resumed greedy run reproduces the uninterrupted one exactly (same batch size).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from data_pipelines.formatting import apply_template
from data_pipelines.records import PromptRecord
from eval.benchmarks import Benchmark, get_benchmark
from eval.generation import Generation, generate_with_engine
from eval.metrics import summarize
from eval.report import write_report
from reward_models.verifiers import Verifier, get_verifier
from vlrft.errors import RunFolderError
from vlrft.rollout import RolloutConfig, SamplingParams, make_engine
from vlrft.rollout.trajectories import turn_log
from vlrft.tracking import video_refs

logger = logging.getLogger("eval")
SAMPLES, METRICS, REPORT, RUN = "samples.jsonl", "metrics.json", "report.html", "run.json"


def image_refs(record: PromptRecord) -> list[str]:
    """How samples.jsonl names a record's images: the path when it has one, else ``<embedded image i>``."""
    return [
        im if isinstance(im, str) and not im.startswith("data:") else f"<embedded image {i}>"
        for i, im in enumerate(record.images)
    ]


def score_problem(
    record: PromptRecord, generations: Sequence[Generation | str], verifier: Verifier, prompt_text: str | None = None
) -> dict[str, Any]:
    """One samples.jsonl row: the record, each response with its extracted answer and verdict."""
    meta = {k: v for k, v in record.metadata.items() if k not in ("response", "answer")}
    responses = []
    for g in generations:
        g = g if isinstance(g, Generation) else Generation(g, None, None)
        extra = {"response_length": g.num_tokens} if g.num_tokens is not None else {}
        try:
            r = verifier(g.text, record.answer, **meta, **extra)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"record {record.id!r}: {exc}") from exc
        responses.append(
            {
                "text": g.text,
                "extracted": r.extracted,
                "correct": bool(r.correct),
                "score": r.score,
                "format_ok": bool(r.format_ok),
                "vote_key": verifier.vote_key(r.extracted),
                "error": r.error,
                "num_chars": len(g.text),
                "num_tokens": g.num_tokens,
                "finish_reason": g.finish_reason,
                **(turn_log(g.trajectory) if g.trajectory is not None else {}),
            }
        )
    return {
        "id": record.id,
        "prompt": prompt_text if prompt_text is not None else record.prompt,
        "images": image_refs(record),
        **({"videos": video_refs(record.videos)} if record.videos else {}),
        "answer": record.answer,
        "num_correct": sum(r["correct"] for r in responses),
        "responses": responses,
    }


def score_records(
    records: Sequence[PromptRecord], responses: Sequence[Sequence[str]], benchmark: str | Benchmark
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Score given responses (``responses[i]``: the n responses to ``records[i]``); returns (metrics, rows)."""
    bench = get_benchmark(benchmark)
    if len(records) != len(responses):
        raise ValueError(f"{len(records)} records but {len(responses)} response lists")
    verifier = get_verifier(bench.verifier)
    rows = [score_problem(rec, resp, verifier) for rec, resp in zip(records, responses)]
    return {
        "benchmark": bench.name,
        "verifier": getattr(bench.verifier, "name", bench.verifier),
        **summarize(rows),
    }, rows


def read_samples(path: Path) -> dict[str, dict[str, Any]]:
    """Finished problems of an interrupted run. A torn last line (killed mid-write) is cut off the file."""
    done: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return done
    data = path.read_bytes()
    good = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        done[row["id"]] = row
        good += len(line)
    if good < len(data):
        logger.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run", path, len(data) - good)
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def run_settings(
    bench: Benchmark,
    num_records: int,
    *,
    n: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int,
    batch_size: int,
    system_prompt: str | None,
    run_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings an evaluation's results depend on, as ``run.json`` holds them."""
    return {
        "benchmark": bench.name,
        "verifier": getattr(bench.verifier, "name", bench.verifier),
        "prompt_template": bench.prompt_template,
        "system_prompt": system_prompt,
        "n": n,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "batch_size": batch_size,
        "num_records": num_records,
        **(run_info or {}),
    }


def check_out_dir(out_dir: str | Path, settings: dict[str, Any], resume: bool) -> None:
    """An evaluation may write into ``out_dir``: when resuming, results already there were made with the same
    ``settings`` (the batch size aside), and a ``samples.jsonl`` without ``run.json`` is nobody's to delete
    (a train-policy run folder has one). Read-only: ``vlrft eval`` calls it before the model loads."""
    out = Path(out_dir)
    if not resume or not (out / SAMPLES).is_file():
        return
    if not (out / RUN).is_file():
        raise RunFolderError(
            f"--out {out}: holds {SAMPLES} but no {RUN}, so not results of vlrft eval (a training run's samples?); "
            f"use another --out, or --overwrite to replace {out / SAMPLES}"
        )
    try:
        old = json.loads((out / RUN).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RunFolderError(
            f"--out {out}: {RUN} is not readable JSON ({exc}); use another --out or --overwrite"
        ) from None
    diff = {k: (old.get(k), v) for k, v in settings.items() if k != "batch_size" and old.get(k) != v}
    if diff:
        changes = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
        raise RunFolderError(
            f"--out {out}: holds results made with other settings ({changes}); use another --out, or --overwrite "
            "to discard them (or remove the folder)"
        )


def _start_run(out_dir: Path, settings: dict[str, Any], resume: bool) -> None:
    check_out_dir(out_dir, settings, resume)
    if not resume and (out_dir / SAMPLES).exists():
        (out_dir / SAMPLES).unlink()
    _write_json(out_dir / RUN, settings)


def evaluate(
    model: Any,
    processor_or_tokenizer: Any,
    records: Sequence[PromptRecord],
    benchmark: str | Benchmark,
    *,
    n: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 512,
    batch_size: int = 8,
    seed: int = 0,
    system_prompt: str | None = None,
    out_dir: str | Path | None = None,
    resume: bool = True,
    report: bool = True,
    progress: bool = False,
    image_kwargs: dict[str, Any] | None = None,
    engine: Any = None,
    run_info: dict[str, Any] | None = None,
    trajectories: Any = None,
    uncounted: int = 0,
) -> dict[str, Any]:
    """Evaluate ``model`` on ``records`` of ``benchmark``; returns the metrics (see ``eval.metrics.summarize``).

    With ``out_dir``: writes ``samples.jsonl`` (appended per batch), ``metrics.json``, ``report.html``
    and ``run.json`` (the settings; a resumed run must match them), and with ``resume`` skips problems
    already in ``samples.jsonl``. Without it nothing is written (the in-training use). Generation goes
    through ``engine`` (a ``vlrft.rollout`` engine, e.g. the trainer's; default: an ``hf`` engine on
    ``model``). Images not loaded yet are loaded by ``data_pipelines.images.load_image(**image_kwargs)``
    (default: the processor's own pixel bounds). ``trajectories``: a ``vlrft.rollout.trajectories.TrajectoryRunner``
    on that engine, for multi-turn rollouts with tools (the report shows each turn with the images tools returned).
    ``uncounted``: the last that many records are padding (``vlrft.sampling.share_over_ranks``: the ranks of a
    sharded model generate in lockstep), generated like the others but left out of the metrics and the report; with
    nothing counted the metrics are ``{"num_problems": 0}``.
    """

    bench = get_benchmark(benchmark)
    counted = len(records) - uncounted
    if uncounted:  # padding copies get ids of their own (ids are unique: resuming relies on them)
        records = [
            *records[:counted],
            *(replace(r, id=f"{r.id}#uncounted{i}") for i, r in enumerate(records[counted:])),
        ]
    if engine is None:
        engine = make_engine(RolloutConfig.on_model(micro_batch_size=batch_size), model, processor_or_tokenizer)
    verifier = get_verifier(bench.verifier)
    if n < 1 or batch_size < 1:
        raise ValueError(f"need n >= 1 and batch_size >= 1, got n={n}, batch_size={batch_size}")
    ids = [r.id for r in records]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"record ids must be unique (resuming relies on them); {dup!r} appears twice")
    settings = run_settings(
        bench,
        len(records),
        n=n,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        seed=seed,
        batch_size=batch_size,
        system_prompt=system_prompt,
        run_info=run_info,
    )
    done: dict[str, dict[str, Any]] = {}
    samples_file = None
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        _start_run(out, settings, resume)
        done = read_samples(out / SAMPLES) if resume else {}
        if done:
            logger.info("%s: resuming, %d of %d problems already done", out, len(done), len(records))
        samples_file = open(out / SAMPLES, "ab")
    batches = [list(records[i : i + batch_size]) for i in range(0, len(records), batch_size)]
    sampling = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    turn_images: dict[tuple[str, int], list[Any]] = {}
    bar = None
    if progress:
        bar = tqdm(total=len(records), initial=sum(r.id in done for r in records), desc=f"eval {bench.name}")
    try:
        for index, batch in enumerate(batches):
            todo = [r for r in batch if r.id not in done]
            if not todo:
                continue
            gens = generate_with_engine(
                engine,
                processor_or_tokenizer,
                todo,
                sampling,
                seed=seed + index,
                system_prompt=system_prompt,
                prompt_template=bench.prompt_template,
                image_kwargs=image_kwargs,
                trajectories=trajectories,
            )
            for r, g in zip(todo, gens):  # the images tools returned, for the report (not kept in samples.jsonl)
                for k, gen in enumerate(g):
                    if gen.trajectory is not None and gen.trajectory.response.images:
                        turn_images[(r.id, k)] = gen.trajectory.response.images
            rows = [
                score_problem(r, g, verifier, apply_template(r.prompt, bench.prompt_template))
                for r, g in zip(todo, gens)
            ]
            if samples_file is not None:  # one write per batch: a kill leaves whole batches (or one torn line)
                samples_file.write(b"".join(json.dumps(row, ensure_ascii=False).encode() + b"\n" for row in rows))
                samples_file.flush()
            done.update((row["id"], row) for row in rows)
            if bar is not None:
                bar.update(len(rows))
    finally:
        if samples_file is not None:
            samples_file.close()
        if bar is not None:
            bar.close()
    rows = [done[i] for i in ids[:counted]]
    if not rows:
        return {"num_problems": 0}
    metrics = {
        "benchmark": bench.name,
        "verifier": getattr(bench.verifier, "name", bench.verifier),
        **summarize(rows, seed=seed),
    }
    if out_dir is not None:
        _write_json(Path(out_dir) / METRICS, {**metrics, "settings": settings})
        if report:
            write_report(
                Path(out_dir) / REPORT,
                metrics,
                rows,
                records[:counted],
                title=f"{bench.name}: {settings.get('model', '')}",
                turn_images=turn_images,
            )
    return metrics
