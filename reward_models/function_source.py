"""``kind: function``: a reward function from the user's own files (``docs/your-task.md``).

    reward:
      sources:
        - name: mine
          kind: function
          function: examples/colors/reward.py:score     # or package.module:score
          signature: sample                             # sample | batch | trl | verl
          function_kwargs: {strict: true}

By default (``isolation: process``) the function runs in a pool of ``num_workers`` worker processes
(``reward_models.function_worker``), with ``timeout_s`` per call (a call scores one sample, or the whole
batch for the batch signatures ``batch`` and ``trl``) and an address-space limit of ``memory_limit_mb``: a
function that raises, hangs, returns NaN or a non-number, returns a list of the wrong length or kills its
worker fails those samples (the pool then gives the source's ``fallback``, or stops the run naming the
record and the reason), and is counted in ``reward/<name>/errors`` and ``reward/<name>/timeouts``.
``isolation: inline`` calls it in the trainer's process (no time limit: for functions you trust to be quick).

Extra numbers in a returned dict (``{"score": 1.0, "format": 0.5}``) are logged as ``reward/<name>/<key>``
(their mean over the samples that returned them, summed as value / n so that huge ones do not overflow); extras
that are not finite numbers, or named as the source's own metrics, are dropped, counted in
``reward/<name>/dropped_extras`` and named once on stderr. What the function prints in its workers goes to their
logs (``vlrft.workers``: ``reward-<name>.*.log`` in the run folder's ``logs/workers``). A function that cannot be
imported, or does not accept its signature, is refused by preflight with the file and line.
"""

from __future__ import annotations

import base64
import math
import pickle
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from reward_models.function_worker import SIGNATURES, call, described, normal
from reward_models.samples import Sample
from reward_models.sources import KIND_HELP, RewardSource, RewardSourceConfig, Scores, SourceContext, source_kind
from reward_models.verifiers import Verifier, VerifierResult
from vlrft.config import ConfigError, option
from vlrft.user_code import check_signature, load_callable, where
from vlrft.workers import WorkerPool

_OWN_METRICS = ("errors", "timeouts", "dropped_extras", "failures", "mean", "std", "min", "max", "n")
# what each signature is called with (positional count, keyword names), for the check before the run
_CALLS = {
    "sample": (1, ()),
    "batch": (1, ()),
    "trl": (0, ("prompts", "completions")),  # and the records' columns, known only with the data
    "verl": (3, ("extra_info",)),
}


@dataclass
class FunctionSourceConfig(RewardSourceConfig):
    """A reward function of yours (docs/your-task.md)."""

    kind: str = option("function", KIND_HELP)
    function: str = option("", "path/to/file.py:name or package.module:name", reads=True)
    signature: str = option("sample", "how it is called (docs/your-task.md)", choices=SIGNATURES)
    function_kwargs: dict = option({}, "keyword arguments it is called with")
    needs: list = option([], "record fields it reads (e.g. [answer]), checked in every record")
    isolation: str = option(
        "process", "process (worker processes, time limit) or inline", choices=("process", "inline")
    )
    timeout_s: float = option(30.0, "time limit of one call (isolation process)", gt=0)
    num_workers: int = option(2, "worker processes (and concurrent calls)", ge=1)
    memory_limit_mb: int = option(4096, "address-space limit of a worker (0: none)", ge=0)


@source_kind(FunctionSourceConfig)
class FunctionSource(RewardSource):
    """The user's function, in worker processes or inline (see the module doc)."""

    reads_videos = True  # Sample.videos: the function is given the video paths

    def __init__(self, cfg: FunctionSourceConfig, context: SourceContext):
        super().__init__(cfg, context)
        self.key = f"reward source {cfg.name!r}"
        self.fn = load_callable(cfg.function, f"{self.key}: function")
        self.where = where(self.fn)
        self.workers = None
        self._warned: set[str] = set()  # extra keys said to be dropped
        if cfg.isolation == "process":
            memory = {"VLRFT_WORKER_MEMORY_MB": str(cfg.memory_limit_mb)}
            self.workers = WorkerPool("reward_models.function_worker", env=memory, log=f"reward-{cfg.name}")
            self.workers.prestart(cfg.num_workers)
        self._threads = ThreadPoolExecutor(max_workers=max(1, cfg.num_workers), thread_name_prefix=f"fn-{cfg.name}")

    @classmethod
    def check(cls, cfg: FunctionSourceConfig, key: str) -> None:
        if not cfg.function:
            raise ConfigError(f"{key}.function: empty; want path/to/file.py:function or package.module:function")
        if cfg.signature not in SIGNATURES:
            raise ConfigError(f"{key}.signature={cfg.signature}: want one of {', '.join(SIGNATURES)}")
        if cfg.isolation not in ("process", "inline"):
            raise ConfigError(f"{key}.isolation={cfg.isolation}: want process or inline")
        if not cfg.timeout_s > 0:
            raise ConfigError(f"{key}.timeout_s={cfg.timeout_s}: must be > 0")
        fn = load_callable(cfg.function, f"{key}.function")
        args, keywords = _CALLS[cfg.signature]
        partial = cfg.signature == "trl"
        check_signature(fn, cfg.function, f"{key}.function", args, keywords + tuple(cfg.function_kwargs), partial)

    @classmethod
    def needs(cls, cfg: FunctionSourceConfig) -> set[str]:
        return set(cfg.needs) | ({"answer"} if cfg.signature == "verl" else set())

    @classmethod
    def describe(cls, cfg: FunctionSourceConfig) -> str:
        return f"function {cfg.function}".strip()

    def _calls(self, samples: list[Sample]) -> list[list[int]]:
        """The samples each call scores: one each, or the whole batch for the batch signatures."""
        if self.cfg.signature in ("sample", "verl"):
            return [[i] for i in range(len(samples))]
        return [list(range(len(samples)))]

    def _run(self, batch: list[Sample]) -> tuple[list[tuple[float | None, dict, str]], str, str]:
        """One call: (normalised results, "", "") or ([], why, "error" | "timeout") when it failed as a whole."""
        c = self.cfg
        if self.workers is None:
            try:
                return [normal(v) for v in call(self.fn, c.signature, batch, dict(c.function_kwargs))], "", ""
            except (Exception, SystemExit, KeyboardInterrupt) as exc:  # noqa: BLE001 - the user's failure, located
                return [], described(exc, self.fn), "error"
        request = {
            "spec": c.function,
            "key": self.key,
            "signature": c.signature,
            "kwargs": dict(c.function_kwargs),
            "samples": batch,
        }
        line, why = self.workers.call(base64.b64encode(pickle.dumps(request)), c.timeout_s)
        if line is None and why == "timeout":
            return [], f"{self.where}: timed out after {c.timeout_s:g} s (its worker was killed)", "timeout"
        if line is None:
            return [], f"{self.where}: its worker {why}", "error"
        reply = pickle.loads(base64.b64decode(line))
        return (reply["values"], "", "") if reply["ok"] else ([], reply["error"], "error")

    def score(self, samples: list[Sample]) -> Scores:
        calls = self._calls(samples)
        results = list(self._threads.map(lambda idx: self._run([samples[i] for i in idx]), calls))
        values, failed = torch.zeros(len(samples)), {}
        sums: dict[str, list[float]] = {}
        errors = timeouts = dropped = 0
        for idx, (got, why, kind) in zip(calls, results):
            if why:
                timeouts += kind == "timeout"
                errors += kind == "error"
                failed.update({i: why for i in idx})
                continue
            for i, (value, extras, bad, lost) in zip(idx, got):
                if value is None:
                    errors += 1
                    failed[i] = f"{self.where}: {bad}"
                    continue
                values[i] = value
                for k, v in extras.items():
                    if k in _OWN_METRICS:
                        lost[k] = "a name of the source's own metrics"
                    else:
                        sums.setdefault(k, []).append(v)
                dropped += len(lost)
                self._report_dropped(lost)
        # the mean as a sum of value / n: no overflow where every value is finite (1e308s average to 1e308)
        extras = {k: math.fsum(x / len(v) for x in v) for k, v in sums.items()}
        counts = {"errors": float(errors), "timeouts": float(timeouts), "dropped_extras": float(dropped)}
        return Scores(values, failed, {**extras, **counts})

    def _report_dropped(self, lost: dict[str, str]) -> None:
        """Say once per extra key that its values are dropped (they are counted in ``dropped_extras``)."""
        for k, why in lost.items():
            if k not in self._warned:
                self._warned.add(k)
                print(
                    f"warning: reward source {self.cfg.name!r} ({self.where}): extra {k!r} dropped: {why} "
                    f"(counted in reward/{self.cfg.name}/dropped_extras)",
                    file=sys.stderr,
                    flush=True,
                )

    def verifier(self) -> Verifier:
        return FunctionVerifier(self)

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        if self.workers is not None:
            self.workers.close()


class FunctionVerifier(Verifier):
    """A function source as a verifier (the held-out accuracy and ``vlrft eval``): its score, correct when
    above 0.5; a failed call scores 0 with the reason as ``error``."""

    needs_answer = False
    extracts = False  # it gives a score, not an answer read from the response

    def __init__(self, source: FunctionSource):
        super().__init__()
        self.source, self.name = source, source.cfg.function

    def check(self, response: str, answer: str | None, **metadata) -> VerifierResult:
        sample = Sample(id=str(metadata.get("id", "")), prompt=str(metadata.get("prompt", "")), response=response)
        sample.answer, sample.metadata = answer, metadata
        scores = self.source.score([sample])
        if scores.failed:
            return VerifierResult(0.0, None, False, False, error=scores.failed[0])
        score = float(scores.values[0])
        return VerifierResult(score, None, score > 0.5, True)
