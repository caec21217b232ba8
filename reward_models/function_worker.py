"""Calling a user's reward function, in this process or in a worker process (``python -m
reward_models.function_worker``, pooled by ``vlrft.workers``).

:func:`call` is the one place that knows the signatures (``docs/your-task.md``):

- ``sample``: ``fn(sample, **kwargs) -> float | dict`` for each sample;
- ``batch``: ``fn(samples, **kwargs) -> list[float | dict]``;
- ``trl``: ``fn(prompts=[...], completions=[...], answer=[...], id=[...], task=[...], images=[...], <metadata
  key>=[...], **kwargs) -> list[float]``, as TRL calls its ``reward_funcs`` (text prompts and completions);
- ``verl``: ``fn(data_source, solution_str, ground_truth, extra_info=..., **kwargs) -> float | dict`` for each
  sample, as verl calls ``compute_score`` (``data_source``: the record's ``metadata.data_source``, else its
  task; ``extra_info``: its metadata with ``id`` and ``prompt``).

It returns one raw result per sample (whatever the function returned; :func:`normal` checks it) or raises.
The worker reads requests as base64 pickles (spec, signature, keyword arguments, samples) and answers
``{"ok": True, "values": [normal(value), ...]}`` or ``{"ok": False, "error": "file:line: Type: message"}``;
its address space is capped at ``VLRFT_WORKER_MEMORY_MB`` (a function that allocates without bound gets a
``MemoryError``). A ``SystemExit`` or ``KeyboardInterrupt`` the function raises is its failure like any other
exception, in the worker and inline alike.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from vlrft.user_code import load_callable, raised_at, source_file, where
from vlrft.workers import serve_pickled

SIGNATURES = ("sample", "batch", "trl", "verl")


class BadReturn(ValueError):
    """A batch function returned something other than one value per sample."""


def call(fn: Callable[..., Any], signature: str, samples: list[Any], kwargs: dict[str, Any]) -> list[Any]:
    """``fn``'s raw results for ``samples`` under ``signature`` (one per sample; raises what ``fn`` raises)."""
    if signature == "sample":
        return [fn(s, **kwargs) for s in samples]
    if signature == "verl":
        return [
            fn(
                s.metadata.get("data_source", s.task),
                s.response,
                s.answer,
                extra_info={**s.metadata, "id": s.id, "prompt": s.prompt},
                **kwargs,
            )
            for s in samples
        ]
    if signature == "trl":
        columns: dict[str, list[Any]] = {
            "answer": [s.answer for s in samples],
            "id": [s.id for s in samples],
            "task": [s.task for s in samples],
            "images": [s.images for s in samples],
        }
        for key in sorted({k for s in samples for k in s.metadata} - set(columns)):
            columns[key] = [s.metadata.get(key) for s in samples]
        out = fn(prompts=[s.prompt for s in samples], completions=[s.response for s in samples], **columns, **kwargs)
    else:
        out = fn(samples, **kwargs)
    if not isinstance(out, (list, tuple)) or len(out) != len(samples):
        got = f"{len(out)} values" if isinstance(out, (list, tuple)) else f"a {type(out).__name__}"
        raise BadReturn(f"returned {got} for {len(samples)} samples; want a list with one value per sample")
    return list(out)


def _number(raw: Any, want: str) -> tuple[float | None, str]:
    """``(value, "")`` of a finite number (a 0-d tensor or numpy scalar too), else ``(None, why)``."""
    if hasattr(raw, "item") and getattr(raw, "ndim", 1) == 0 and not isinstance(raw, (int, float)):
        raw = raw.item()
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return None, f"returned {type(raw).__name__} {str(raw)[:40]!r}; want {want}"
    try:
        value = float(raw)
    except OverflowError:
        return None, f"returned an integer of {raw.bit_length()} bits, too large for a float"
    return (value, "") if math.isfinite(value) else (None, f"returned {value}")


def normal(raw: Any) -> tuple[float | None, dict[str, float], str, dict[str, str]]:
    """``(score, extras, "", dropped)`` from one raw result (a number, or a dict with ``score`` and extra numbers),
    or ``(None, {}, why, {})`` when it is not one (a NaN, a string, None, an integer too large for a float, a dict
    without a numeric score). ``dropped``: the extras that are not finite numbers, with why (counted and reported
    by the source, never silently lost)."""
    extras: dict[str, float] = {}
    dropped: dict[str, str] = {}
    if isinstance(raw, dict):
        if "score" not in raw:
            return None, {}, f"returned a dict without 'score' (keys {sorted(map(str, raw))[:5]})", {}
        for k, v in raw.items():
            if k != "score":
                value, why = _number(v, "a finite number")
                if value is None:
                    dropped[str(k)] = why.removeprefix("returned ")
                else:
                    extras[str(k)] = value
        raw = raw["score"]
    value, why = _number(raw, "a number or a dict with 'score'")
    if value is None:
        return None, {}, why, {}
    return value, extras, "", dropped


def described(exc: BaseException, fn: Callable[..., Any]) -> str:
    """``file:line: Type: message`` at the user's line (:func:`~vlrft.user_code.raised_at` in ``fn``'s file); for a
    :class:`BadReturn`, ``fn``'s definition and what it returned. A ``SystemExit`` or ``KeyboardInterrupt`` the
    user's code raised is a failure of that code like any other (it never ends the run)."""
    if isinstance(exc, BadReturn):
        return f"{where(fn)}: {exc}"
    at = raised_at(exc, source_file(fn))
    if isinstance(exc, SystemExit):
        return f"{at}SystemExit({exc.code!r}): a reward function may not end the run"
    return f"{at}{type(exc).__name__}: {str(exc)[:300]}"


def _handle(req: dict[str, Any]) -> dict[str, Any]:  # runs in the worker process
    fn = None
    try:
        fn = load_callable(req["spec"], req["key"])
        values = call(fn, req["signature"], req["samples"], req["kwargs"])
        return {"ok": True, "values": [normal(v) for v in values]}
    except BaseException as exc:  # noqa: BLE001 - any failure of the user's code is reported, located
        return {"ok": False, "error": described(exc, fn)}


if __name__ == "__main__":
    serve_pickled(_handle)
