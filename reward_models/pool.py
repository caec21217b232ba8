"""The reward pool: rule verifiers, scalar RMs and generative RMs scoring the same samples together.

Configured as a list of sources (``kind: verifier | srm | grm | function | http | openai_judge``, a name, a
weight, and the keys of the kind's own config; each kind a class registered in ``reward_models.kinds``, which
the pool uses only through their one protocol) and optional per-task recipes. For sample ``i`` whose record has
task ``t``, the applicable sources and weights are ``recipes[t]`` if present, else ``recipes["default"]`` if
present, else every source with its own ``weight``. The combined reward is

    combined_i = sum over applicable sources s of  w_{t,s} * r_{i,s}

A source that does not apply to a sample does not score it; its entry in ``per_source`` is NaN there
(never a made-up zero). A source that fails on a sample (an exception, or a non-finite reward) raises
:class:`RewardSourceError` naming it, the record and the reason, unless it has a ``fallback`` value, which
then replaces the failed rewards and is counted in ``reward/<name>/failures`` (the first failure of each
source is also printed once, with the record id and the reason); with a fallback, failures on more than
``max_failure_share`` of a step's samples of that source stop the run all the same.

A ``grm`` source with ``judge_mode: pairwise`` compares responses instead of judging each
(``reward_models.pairwise``: win rate against the group, or preference over the reference answer). Every
call also logs the diagnostics of ``reward_models.diagnostics`` (rank agreement between sources within
groups, correlation with the accuracy verifier, the reward-hacking alarm) unless ``diagnostics_window: 0``.

Sources that hold a model are loaded once (on CPU). With ``offload: true`` each is moved to the scoring
device only while it scores and back to CPU memory afterwards; ``offload: false`` keeps it resident on the
device after its first call. Each scores in micro-batches. Sources without a model run on threads,
concurrently with those that hold one (which take turns on the device).
"""

from __future__ import annotations

import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from data_pipelines.records import PromptRecord
from reward_models.diagnostics import PoolDiagnostics
from reward_models.function_source import FunctionSourceConfig
from reward_models.kinds import SOURCE_CONFIG, SOURCE_KINDS, check_source, make_source
from reward_models.samples import samples_of
from reward_models.sources import (
    RewardSource,
    RewardSourceError,  # noqa: F401 - the trainers and tests import it from here
    Scores,
)
from vlrft.algorithms.shaping import combine_rewards
from vlrft.config import ConfigError, option


@dataclass
class RewardPoolConfig:
    """Reward sources, their weights and per-task recipes."""

    sources: list[Any] = option(
        [], "the reward sources, each with the keys of its kind (a verifier when it names none)", union=SOURCE_CONFIG
    )
    recipes: dict[str, dict[str, float]] = field(
        default_factory=dict,
        metadata={"help": "task label -> {source name: weight}; 'default' for tasks without a recipe"},
    )
    offload: bool = option(True, "keep neural reward models in CPU memory except while they score")
    device: str = option("auto", "scoring device: auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    num_threads: int = option(4, "threads for rule verifiers")
    diagnostics_window: int = option(10, "steps in the reward-hacking alarm's window (0: no pool diagnostics)")
    alarm_delta: float = option(0.05, "alarm when a neural reward rises and accuracy falls by more than this")
    accuracy_source: str = option("", "verifier source the diagnostics compare with (empty: the first verifier)")

    def validate(self) -> None:
        names = [s.name for s in self.sources]
        if not names:
            raise ValueError("the reward pool needs at least one source")
        if any(not n for n in names) or len(set(names)) != len(names):
            raise ValueError(f"reward sources need unique, non-empty names; got {names}")
        for s in self.sources:
            if s.kind not in SOURCE_KINDS:
                kinds = tuple(SOURCE_KINDS)
                raise ValueError(f"reward source {s.name!r}: kind {s.kind!r} is not allowed; choose one of {kinds}")
        if self.accuracy_source and self.accuracy_source not in names:
            raise ValueError(f"accuracy_source {self.accuracy_source!r} is not a source; sources: {names}")
        for task, weights in self.recipes.items():
            unknown = sorted(set(weights) - set(names))
            if unknown:
                raise ValueError(f"recipe {task!r} names unknown sources {unknown}; sources: {names}")
            for name, w in weights.items():
                if not math.isfinite(w):
                    raise ValueError(f"reward.recipes.{task}.{name}={w}: must be finite")


@dataclass
class PoolOutput:
    per_source: dict[str, torch.Tensor]  # [N] each; NaN where the source does not apply
    combined: torch.Tensor  # [N]
    metrics: dict[str, float]


def combine(per_source: dict[str, torch.Tensor], weights: list[dict[str, float]]) -> torch.Tensor:
    """``combined_i = sum_s weights[i][s] * per_source[s][i]`` over the sources in ``weights[i]`` (a sample's
    recipe): the samples of each recipe are summed by :func:`~vlrft.algorithms.shaping.combine_rewards`;
    a recipe without sources gives 0."""
    out = torch.zeros(len(weights), dtype=torch.float32)
    recipes: dict[tuple[tuple[str, float], ...], list[int]] = {}
    for i, w in enumerate(weights):
        recipes.setdefault(tuple(w.items()), []).append(i)
    for recipe, rows in recipes.items():
        if recipe:
            idx = torch.tensor(rows)
            out[idx] = combine_rewards({name: per_source[name][idx] for name, _ in recipe}, dict(recipe)).float()
    return out


# -- the pool ------------------------------------------------------------------------------------
class RewardPool:
    """``score(records, responses) -> PoolOutput``; records are repeated per sample (one per response)."""

    def __init__(
        self,
        cfg: RewardPoolConfig,
        device: str | torch.device | None = None,
        prepare_model: Callable[[torch.nn.Module], Any] | None = None,
    ):
        """``prepare_model``: applied to each model the pool's sources hold, once loaded (the trainer's
        ``strategy.compute_like_policy``: they compute as the policy does, with its CPU products' kernels)."""
        cfg.validate()
        self.cfg = cfg
        dev = device or cfg.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(dev)
        self._threads = ThreadPoolExecutor(max_workers=max(1, cfg.num_threads), thread_name_prefix="verifier")
        self._sources = ThreadPoolExecutor(max_workers=len(cfg.sources), thread_name_prefix="reward-source")
        self.sources: dict[str, RewardSource] = {}
        for i, s in enumerate(cfg.sources):
            check_source(s, f"reward.sources[{i}]")  # the kind's own rules (preflight ran them too)
            self.sources[s.name] = make_source(s, self.device, cfg.offload, self._threads)
            if prepare_model is not None and getattr(self.sources[s.name], "model", None) is not None:
                prepare_model(self.sources[s.name].model)
        # the sources that grade a response on their own, and the one the accuracy is read from
        self.graders = {n: v for n, v in ((n, src.verifier()) for n, src in self.sources.items()) if v is not None}
        self.accuracy_source = cfg.accuracy_source or next(iter(self.graders), "")
        models = [n for n, src in self.sources.items() if src.holds_model]
        self.diagnostics = (
            PoolDiagnostics(models, self.accuracy_source, cfg.diagnostics_window, cfg.alarm_delta)
            if cfg.diagnostics_window > 0
            else None
        )
        self._reported: set[str] = set()

    def weights_for(self, task: str) -> dict[str, float]:
        """The sources and weights that apply to a record of ``task``."""
        if task in self.cfg.recipes:
            return dict(self.cfg.recipes[task])
        if "default" in self.cfg.recipes:
            return dict(self.cfg.recipes["default"])
        return {s.name: s.weight for s in self.cfg.sources}

    def score(
        self,
        records: list[PromptRecord],
        responses: list[str],
        extra: list[dict] | None = None,
        trajectories: list[list[dict] | None] | None = None,
        diagnose: bool = True,
    ) -> PoolOutput:
        """Score sample ``i`` = (``records[i]``, ``responses[i]``). ``extra[i]`` (optional) adds keyword
        arguments for the verifiers, e.g. ``{"response_length": 412}`` (tokens) for ``length_penalty``;
        ``trajectories[i]`` the conversation after the prompt of a multi-turn response (``Sample.trajectory``).
        ``diagnose=False`` keeps the call out of the diagnostics' window (probes of made-up responses,
        ``reward_models.probes``, must not move the reward-hacking alarm of the rollouts)."""
        if len(records) != len(responses) or (extra is not None and len(extra) != len(records)):
            raise ValueError(
                f"{len(records)} records, {len(responses)} responses"
                + (f", {len(extra)} extra" if extra is not None else "")
                + " (one each per sample)"
            )
        n = len(records)
        samples = samples_of(records, responses, extra, trajectories)
        weights = [self.weights_for(r.task) for r in records]
        rows = {name: [i for i in range(n) if name in weights[i]] for name in self.sources}
        per_source = {name: torch.full((n,), math.nan) for name in self.sources}
        metrics: dict[str, float] = {}
        started = {}
        for name, src in self.sources.items():  # model-free sources run while the others score
            if rows[name] and not src.holds_model:
                batch = [samples[i] for i in rows[name]]
                started[name] = (time.perf_counter(), self._sources.submit(src.score, batch))
        for name, src in self.sources.items():
            if rows[name] and src.holds_model:
                t0 = time.perf_counter()
                scores = self._scores(src, [samples[i] for i in rows[name]])
                per_source[name][rows[name]], taken = self._take(name, rows[name], records, scores)
                metrics.update(taken)
                metrics[f"time/reward/{name}"] = time.perf_counter() - t0
        for name, (t0, future) in started.items():
            try:
                scores = future.result()
            except Exception as exc:  # noqa: BLE001 - the whole call failed: every sample
                scores = _all_failed(len(rows[name]), exc)
            per_source[name][rows[name]], taken = self._take(name, rows[name], records, scores)
            metrics.update(taken)
            metrics[f"time/reward/{name}"] = time.perf_counter() - t0
        combined = combine(per_source, weights)
        for name, values in per_source.items():
            metrics.update(_stats(f"reward/{name}", values[rows[name]]))
        metrics.update(_stats("reward/combined", combined))
        if self.diagnostics is not None and diagnose:
            metrics.update(self.diagnostics.step(per_source, [r.id for r in records]))
        return PoolOutput(per_source, combined, metrics)

    @staticmethod
    def _scores(src: RewardSource, batch: list) -> Scores:
        try:
            return src.score(batch)
        except Exception as exc:  # noqa: BLE001 - the whole call failed: every sample
            return _all_failed(len(batch), exc)

    def _take(
        self, name: str, idx: list[int], records: list[PromptRecord], scores: Scores
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The source's values for the samples ``idx`` and its metrics: failed and non-finite values get the
        fallback, or stop the run (:class:`RewardSourceError`)."""
        src = self.sources[name]
        values = scores.values.detach().float().cpu().reshape(-1)
        failed = dict(scores.failed)
        if values.numel() != len(idx):
            failed = {i: f"returned {values.numel()} values for {len(idx)} samples" for i in range(len(idx))}
            values = torch.zeros(len(idx))
        for i in torch.nonzero(~torch.isfinite(values)).flatten().tolist():
            failed.setdefault(i, f"non-finite reward {values[i].item()}")
        metrics = {f"reward/{name}/{k}": float(v) for k, v in scores.extras.items()}
        if failed:
            first, why = min(failed.items())
            record = records[idx[first]].id
            fallback, share = src.cfg.fallback, len(failed) / len(idx)
            where = f"reward source {name!r} ({src.kind}) failed on record {record!r}: {why}"
            if fallback is None:
                raise RewardSourceError(f"{where} (no fallback set: reward.sources[].fallback)")
            if share > src.cfg.max_failure_share:
                raise RewardSourceError(
                    f"{where}; {len(failed)} of {len(idx)} samples failed this step, more than "
                    f"max_failure_share={src.cfg.max_failure_share:g}"
                )
            if name not in self._reported:
                self._reported.add(name)
                print(
                    f"warning: {where}; given the fallback {fallback:g} (counted in reward/{name}/failures)",
                    file=sys.stderr,
                    flush=True,
                )
            values[list(failed)] = float(fallback)
            metrics[f"reward/{name}/failures"] = float(len(failed))
        return values, metrics

    def state_dict(self) -> dict:
        """What a resumed run needs to score on as if never stopped (the diagnostics' window)."""
        return {"diagnostics": self.diagnostics.state_dict() if self.diagnostics is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if self.diagnostics is not None and state.get("diagnostics") is not None:
            self.diagnostics.load_state_dict(state["diagnostics"])

    def close(self) -> None:
        for src in self.sources.values():
            src.close()
        self._sources.shutdown(wait=True)
        self._threads.shutdown(wait=True)


def user_verifier(spec: str, key: str = "--verifier") -> Any:
    """A user's reward function (``path/to/file.py:name`` or ``module:name``, called as ``fn(sample)``) as a
    verifier for ``vlrft eval`` and held-out accuracy: in a worker process with the source defaults' time limit;
    correct when its score is above 0.5."""
    cfg = FunctionSourceConfig(name=spec, function=spec, max_failure_share=1.0)
    try:
        check_source(cfg, "verifier")
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("verifier.function=", f"{key}=", 1)) from None
    return make_source(cfg, torch.device("cpu"), offload=False).verifier()


def _all_failed(n: int, exc: Exception) -> Scores:
    return Scores(torch.zeros(n), {i: f"{type(exc).__name__}: {exc}" for i in range(n)})


def _check_finite(name: str, values: torch.Tensor) -> None:
    if not torch.isfinite(values).all():
        raise ValueError(f"non-finite reward from source {name!r}: {values.tolist()}")


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {f"{prefix}/n": 0.0}
    v = values.double()
    return {
        f"{prefix}/mean": float(v.mean()),
        f"{prefix}/std": float(v.std(unbiased=False)),
        f"{prefix}/min": float(v.min()),
        f"{prefix}/max": float(v.max()),
        f"{prefix}/n": float(v.numel()),
    }
