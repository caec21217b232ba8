"""One protocol for every reward source, and the registry of their kinds.

A source scores a batch of :class:`~reward_models.samples.Sample` and returns a :class:`Scores`: one value
per sample, the samples it failed on (with why), and named extra values the pool logs as metrics. Besides
``score`` a source kind declares, as class-level facts the pool and preflight read without knowing kinds:

- ``check(cfg, key)``: the source's own config rules, before anything loads (a model folder that must exist,
  a verifier that must be registered, a user function that must import and accept its signature);
- ``needs(cfg)``: the record fields it reads (``{"answer"}``), which preflight checks in every record;
- ``holds_model``: whether it holds a model (the pool moves it to the scoring device only while it scores,
  runs the others concurrently, and the diagnostics compare the two groups);
- ``verifier()``: a :class:`~reward_models.verifiers.Verifier` that gives the same scores, for sources that can
  grade a response on their own (the held-out accuracy and ``vlrft eval`` use it), else None.
- ``compare(items)``: preferences between two responses, for sources that compare (pairwise judges), else None
  (the swap probe of ``reward_models.probes`` asks both orders).

A new kind is one class registered with :func:`source_kind`; the pool, preflight and the trainers need no
change. Built in: ``verifier`` (rule verifiers), ``srm`` (scalar reward model), ``grm`` (generative judge,
pointwise or pairwise), ``function`` (a user's reward function, ``reward_models.function_source``), ``http``
(a source served by ``vlrft serve-reward-model``) and ``openai_judge`` (a judge behind an OpenAI-compatible
server; both ``reward_models.remote_sources``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

import torch

from reward_models.generative import GenerativeRewardModel
from reward_models.pairwise import PairwiseJudge
from reward_models.samples import Sample
from reward_models.scalar import ScalarRewardModel, score_responses
from reward_models.verifiers import check_verifier, get_verifier
from vlrft.config import ConfigError
from vlrft.errors import KnownError
from vlrft.models.loading import check_model_folder, load_processor

SOURCE_KINDS: dict[str, type["RewardSource"]] = {}


class RewardSourceError(KnownError):
    """A reward source failed and has no fallback (or could not start: a reward server that does not answer)."""


def source_kind(name: str) -> Callable[[type["RewardSource"]], type["RewardSource"]]:
    """Class decorator: register a reward source kind under ``name`` (the ``kind:`` of its config)."""

    def register(cls: type[RewardSource]) -> type[RewardSource]:
        cls.kind = name
        SOURCE_KINDS[name] = cls
        return cls

    return register


@dataclass
class Scores:
    """What a source returns for ``n`` samples."""

    values: torch.Tensor  # [n] float; any value at a failed position is ignored
    failed: dict[int, str] = field(default_factory=dict)  # sample index -> why it could not be scored
    extras: dict[str, float] = field(default_factory=dict)  # logged as metrics (names without the prefix)


class RewardSource:
    """Base class of the source kinds (see the module doc)."""

    kind: ClassVar[str] = ""
    holds_model: ClassVar[bool] = False

    def __init__(self, cfg: Any, device: torch.device, offload: bool):
        self.cfg, self.name, self.device, self.offload = cfg, cfg.name, device, offload

    @classmethod
    def check(cls, cfg: Any, key: str) -> None:
        """Raise :class:`~vlrft.config.ConfigError` (naming ``key``) when ``cfg`` cannot make this source."""

    @classmethod
    def needs(cls, cfg: Any) -> set[str]:
        """The record fields this source reads (checked in every record by preflight)."""
        return set()

    @classmethod
    def describe(cls, cfg: Any) -> str:
        """How messages name what the source is (e.g. ``verifier vocab_answer``)."""
        return f"{cls.kind} {getattr(cfg, 'function', '') or getattr(cfg, 'path', '') or ''}".strip()

    def score(self, samples: list[Sample]) -> Scores:
        raise NotImplementedError

    def verifier(self) -> Any:
        return None

    def compare(self, items: list[tuple[str, list, str, str]]) -> list[float] | None:
        """Preferences for ``a`` over ``b`` (1, 0.5, 0) of ``(prompt, images, a, b)`` items, for sources that
        compare two responses (pairwise judges: ``reward_models.probes`` swaps the order); None for the others."""
        return None

    def close(self) -> None:
        pass


def make_source(cfg: Any, device: torch.device, offload: bool) -> RewardSource:
    return SOURCE_KINDS[cfg.kind](cfg, device, offload)


def check_source(cfg: Any, key: str) -> None:
    """The source's kind and its own rules (``key``: e.g. ``reward.sources[0]``)."""
    if cfg.kind not in SOURCE_KINDS:
        raise ConfigError(f"{key}.kind={cfg.kind}: unknown reward source kind; known: {', '.join(SOURCE_KINDS)}")
    SOURCE_KINDS[cfg.kind].check(cfg, key)


# -- rule verifiers --------------------------------------------------------------------------------
@source_kind("verifier")
class VerifierSource(RewardSource):
    """A registered rule verifier (``verifier:``, default the source's name; a function of the user's is
    ``kind: function``); each sample is verified on its own, on the pool's verifier threads."""

    def __init__(self, cfg: Any, device: torch.device, offload: bool, executor: Any = None):
        super().__init__(cfg, device, offload)
        self._verifier = get_verifier(cfg.verifier or cfg.name, **dict(cfg.verifier_options))
        self.executor = executor  # set by the pool: samples are verified concurrently

    @classmethod
    def check(cls, cfg: Any, key: str) -> None:
        check_verifier(cfg.verifier or cfg.name, f"{key}.verifier", **dict(cfg.verifier_options))

    @classmethod
    def needs(cls, cfg: Any) -> set[str]:
        return {"answer"} if get_verifier(cfg.verifier or cfg.name).needs_answer else set()

    @classmethod
    def describe(cls, cfg: Any) -> str:
        return f"verifier {cfg.verifier or cfg.name}"

    def _one(self, sample: Sample) -> float:
        return float(self._verifier(sample.response, sample.answer, **{**sample.metadata, **sample.extra}).score)

    def score(self, samples: list[Sample]) -> Scores:
        run = self.executor.submit if self.executor is not None else None
        futures = [run(self._one, s) if run else None for s in samples]
        values, failed = torch.zeros(len(samples)), {}
        for i, s in enumerate(samples):
            try:
                values[i] = futures[i].result() if run else self._one(s)
            except Exception as exc:  # noqa: BLE001 - reported by the pool with the record id
                failed[i] = f"{type(exc).__name__}: {exc}"
        return Scores(values, failed)

    def verifier(self) -> Any:
        return self._verifier


# -- neural sources --------------------------------------------------------------------------------
class ModelSource(RewardSource):
    """A source holding a model, loaded once on CPU and moved to the scoring device only while it scores
    (``offload``), or resident there after its first call."""

    holds_model = True

    def __init__(self, cfg: Any, device: torch.device, offload: bool):
        super().__init__(cfg, device, offload)
        self.model = self.processor = None
        self.resident = False  # True while the model sits on the scoring device (between calls: offload off)
        self.n_loads = self.n_offloads = 0  # moves to the device / back to CPU memory
        self.scored_on: list[str] = []  # the parameters' device at each scoring call

    @classmethod
    def check(cls, cfg: Any, key: str) -> None:
        if not cfg.path:
            raise ConfigError(f"{key}.path: empty; a {cfg.kind} source needs its model folder")
        check_model_folder(cfg.path, f"{key}.path")

    @property
    def parameter_device(self) -> torch.device:
        return next(self.model.parameters()).device

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """The model on the scoring device for the block (and back to CPU memory after it, with offload)."""
        if not self.resident:
            self.model.to(self.device)
            self.resident = True
            self.n_loads += 1
        self.scored_on.append(str(self.parameter_device))
        try:
            yield
        finally:
            if self.offload:
                self.model.to("cpu")  # a no-op copy on CPU-only machines; the bookkeeping is the same
                self.resident = False
                self.n_offloads += 1

    def score(self, samples: list[Sample]) -> Scores:
        with self.on_device():
            return self._score(samples)

    def _score(self, samples: list[Sample]) -> Scores:
        raise NotImplementedError


@source_kind("srm")
class ScalarRMSource(ModelSource):
    """A scalar reward model (``ScalarRewardModel.save_pretrained`` folder): one value per response."""

    def __init__(self, cfg: Any, device: torch.device, offload: bool):
        super().__init__(cfg, device, offload)
        self.model = ScalarRewardModel.from_pretrained(cfg.path).eval().requires_grad_(False)
        self.processor = load_processor(cfg.path)

    def _score(self, samples: list[Sample]) -> Scores:
        items = [(s.prompt, s.images, s.response, s.system) for s in samples]
        c = self.cfg
        return Scores(score_responses(self.model, self.processor, items, c.micro_batch_size, c.max_length, self.device))


@source_kind("grm")
class JudgeSource(ModelSource):
    """A generative judge: ``judge_mode: pointwise`` judges each response (its verdict parsed into a
    reward), ``pairwise`` compares responses (``reward_models.pairwise``); unparsable judgments are counted."""

    def __init__(self, cfg: Any, device: torch.device, offload: bool):
        super().__init__(cfg, device, offload)
        self.grm = GenerativeRewardModel.from_pretrained(
            cfg.path,
            template=cfg.judge_template,
            system=cfg.judge_system_prompt,
            max_new_tokens=cfg.max_new_tokens,
            default=cfg.unparsable_reward,
            score_max=cfg.score_max,
            engine=cfg.engine,
        )
        self.model, self.processor = self.grm.model, self.grm.processor
        self.model.eval().requires_grad_(False)
        self.pairwise = PairwiseJudge(self.grm, cfg.debias) if cfg.judge_mode == "pairwise" else None

    @classmethod
    def needs(cls, cfg: Any) -> set[str]:
        return {"answer"} if cfg.judge_mode == "pairwise" and cfg.pairwise_against == "reference" else set()

    def compare(self, items: list[tuple[str, list, str, str]]) -> list[float] | None:
        if self.pairwise is None:
            return None
        with self.on_device():
            return self.pairwise.compare(items, self.cfg.micro_batch_size)

    def _score(self, samples: list[Sample]) -> Scores:
        c = self.cfg
        if self.pairwise is not None:
            before = self.pairwise.n_unparsable
            values = self.pairwise.score(samples, [s.response for s in samples], c.pairwise_against, c.micro_batch_size)
            unparsable = float(self.pairwise.n_unparsable - before)
            return Scores(torch.tensor(values, dtype=torch.float32), extras={"unparsable": unparsable})
        before = self.grm.parser.n_unparsable
        values, _ = self.grm.score([(s.prompt, s.images, s.response, s.system) for s in samples], c.micro_batch_size)
        return Scores(values, extras={"unparsable": float(self.grm.parser.n_unparsable - before)})
