"""One protocol for every reward source, each kind's config, and the kinds built on a model or a rule.

A source scores a batch of :class:`~reward_models.samples.Sample` and returns a :class:`Scores`: one value
per sample, the samples it failed on (with why), and named extra values the pool logs as metrics. Besides
``score`` a source kind declares, as class-level facts the pool and preflight read without knowing kinds:

- ``check(cfg, key)``: the source's own config rules, before anything loads (a model folder that must exist,
  a verifier that must be registered, a user function that must import and accept its signature);
- ``needs(cfg)``: the record fields it reads (``{"answer"}``), which preflight checks in every record;
- ``holds_model``: whether it holds a model (the pool moves it to the scoring device only while it scores,
  runs the others concurrently, and the diagnostics compare the two groups);
- ``reads_images``: whether it looks at the samples' images (a rule verifier does not: ``vlrft
  serve-reward-model`` then never decodes them);
- ``verifier()``: a :class:`~reward_models.verifiers.Verifier` that gives the same scores, for sources that can
  grade a response on their own (the held-out accuracy and ``vlrft eval`` use it), else None.
- ``compare(items)``: preferences between two responses, for sources that compare (pairwise judges), else None
  (the swap probe of ``reward_models.probes`` asks both orders).

Each kind has its own config: a dataclass extending :class:`RewardSourceConfig` (the keys every source has:
``name``, ``kind``, ``weight``, ``fallback``, ``max_failure_share``) with the kind's keys, declared beside the
kind's class and tied to it by :func:`source_kind`. A config file's source is built into its kind's dataclass
(a tagged union under ``kind``, ``vlrft.config_union``), so a key of another kind is refused naming the kind's
keys. A source is constructed with its config and a :class:`SourceContext` (the device, offloading, the threads
the pool lends). A new kind is one class and its config, plus its line in ``reward_models.kinds`` (where the
kinds are registered); the pool, preflight and the trainers need no change. Built in: ``verifier`` (rule
verifiers), ``srm`` (scalar reward model), ``grm`` (generative judge, pointwise or pairwise; all three here),
``function`` (a user's reward function, ``reward_models.function_source``), ``http`` (a source served by
``vlrft serve-reward-model``) and ``openai_judge`` (a judge behind an OpenAI-compatible server; both
``reward_models.remote_sources``).
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Optional

import torch

from data_pipelines.formatting import JUDGE_SYSTEM_PROMPT, POINTWISE_JUDGE_TEMPLATE
from data_pipelines.records import media
from reward_models.generative import GenerativeRewardModel
from reward_models.judgments import MODES
from reward_models.pairwise import AGAINST, DEBIAS, PairwiseJudge
from reward_models.samples import Sample
from reward_models.scalar import ScalarRewardModel, score_responses
from reward_models.verifiers import check_verifier, get_verifier
from vlrft.config import ConfigError, option
from vlrft.errors import KnownError
from vlrft.models.loading import check_model_folder, load_processor
from vlrft.models.offload import Offloadable
from vlrft.rollout import DEFAULT_ENGINE, ENGINES

KIND_HELP = (
    "rule verifier, scalar RM, generative RM, a function of yours (docs/your-task.md), a reward server or an "
    "OpenAI-compatible judge (docs/reward-models.md)"
)


class RewardSourceError(KnownError):
    """A reward source failed and has no fallback (or could not start: a reward server that does not answer)."""


@dataclass
class RewardSourceConfig:
    """The keys of every reward source; each kind's config extends it with its own (see the module doc)."""

    name: str = option("", "the source's name (keys of per_source, recipes and metrics)")
    kind: str = option("", KIND_HELP)
    weight: float = option(1.0, "weight in the combined reward when no recipe applies", finite=True)
    fallback: Optional[float] = option(
        None, "reward given when the source fails (null: a failure is an error)", finite=True
    )
    max_failure_share: float = option(
        0.5, "stop the run when more than this share of a step's samples fail, even with a fallback", ge=0, le=1
    )


@dataclass(frozen=True)
class SourceContext:
    """What the pool (or the reward server) gives every source it builds: the scoring ``device``, whether a
    model goes back to CPU memory between calls (``offload``), and threads to score samples on concurrently
    (``executor``; None: one after another)."""

    device: torch.device
    offload: bool = False
    executor: Optional[Executor] = None


def source_kind(config: type[RewardSourceConfig]) -> Callable[[type["RewardSource"]], type["RewardSource"]]:
    """Class decorator: the source class of the kind whose config is ``config`` (its ``kind`` default names the
    kind); registered in ``reward_models.kinds``."""

    def declare(cls: type[RewardSource]) -> type[RewardSource]:
        cls.config, cls.kind = config, next(f.default for f in fields(config) if f.name == "kind")
        return cls

    return declare


@dataclass
class Scores:
    """What a source returns for ``n`` samples."""

    values: torch.Tensor  # [n] float; any value at a failed position is ignored
    failed: dict[int, str] = field(default_factory=dict)  # sample index -> why it could not be scored
    extras: dict[str, float] = field(default_factory=dict)  # logged as metrics (names without the prefix)


class RewardSource:
    """Base class of the source kinds (see the module doc)."""

    kind: ClassVar[str] = ""
    config: ClassVar[type[RewardSourceConfig]] = RewardSourceConfig
    holds_model: ClassVar[bool] = False
    reads_images: ClassVar[bool] = True  # (unknown for a user's function: assumed)
    # whether it sees the samples' videos (a reward model encodes them, a user's function gets ``Sample.videos``); a
    # source that reads images but not videos would score a video prompt without its video: preflight refuses it
    reads_videos: ClassVar[bool] = False

    def __init__(self, cfg: Any, context: SourceContext):
        self.cfg, self.name = cfg, cfg.name
        self.device, self.offload, self.executor = context.device, context.offload, context.executor

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
        return cls.kind

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


# -- rule verifiers --------------------------------------------------------------------------------
@dataclass
class VerifierSourceConfig(RewardSourceConfig):
    """A registered rule verifier."""

    kind: str = option("verifier", KIND_HELP)
    verifier: str = option("", "registered verifier name (default: the source's name)")
    verifier_options: dict = option({}, "options of the verifier, e.g. {timeout_s: 2}")


@source_kind(VerifierSourceConfig)
class VerifierSource(RewardSource):
    """A registered rule verifier (``verifier:``, default the source's name; a function of the user's is
    ``kind: function``); each sample is verified on its own, on the context's threads (the pool's verifier
    threads) when it has them."""

    reads_images = False  # a verifier reads the response, the answer and the metadata

    def __init__(self, cfg: VerifierSourceConfig, context: SourceContext):
        super().__init__(cfg, context)
        self._verifier = get_verifier(cfg.verifier or cfg.name, **dict(cfg.verifier_options))

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
@dataclass
class ModelSourceConfig(RewardSourceConfig):
    """The keys of the kinds that hold a model (srm, grm)."""

    path: str = option("", "model folder (srm: ScalarRewardModel.save_pretrained; grm: a judge checkpoint)", reads=True)
    micro_batch_size: int = option(8, "samples per forward", ge=1)


@dataclass
class SRMSourceConfig(ModelSourceConfig):
    """A scalar reward model: one value per response."""

    kind: str = option("srm", KIND_HELP)
    max_length: int = option(4096, "longest tokenised prompt+response")


@dataclass
class JudgeTextConfig(RewardSourceConfig):
    """The judge prompt and how its verdict is read (grm, openai_judge)."""

    max_new_tokens: int = option(32, "judgment length limit")
    judge_template: str = option(POINTWISE_JUDGE_TEMPLATE, "judge user text with {prompt} and {response}")
    judge_system_prompt: str = option(JUDGE_SYSTEM_PROMPT, "judge system turn (empty: the chat template's default)")
    unparsable_reward: float = option(0.0, "reward of an unparsable judgment (counted)")
    score_max: float = option(1.0, "pointwise numeric judgments are divided by this")
    judge_mode: str = option(
        "pointwise", "pointwise (judge each response) or pairwise (compare responses; grm only)", choices=MODES
    )


@dataclass
class GRMSourceConfig(ModelSourceConfig, JudgeTextConfig):
    """A generative judge: pointwise (a verdict per response) or pairwise (responses compared)."""

    kind: str = option("grm", KIND_HELP)
    pairwise_against: str = option(
        "group", "pairwise: score = win rate against the group, or preference over the reference", choices=AGAINST
    )
    debias: str = option("none", "pairwise: swap = judge both orders and average (position bias)", choices=DEBIAS)
    engine: str = option(
        DEFAULT_ENGINE, "the rollout engine generating judgments (vllm needs .venv-vllm)", choices=ENGINES
    )


class ModelSource(RewardSource, Offloadable):
    """A source holding a model, loaded once on CPU and moved to the scoring device only while it scores
    (``offload``), or resident there after its first call (:class:`~vlrft.models.offload.Offloadable`)."""

    holds_model = True

    def __init__(self, cfg: ModelSourceConfig, context: SourceContext):
        super().__init__(cfg, context)
        self.model = self.processor = None
        self.init_residency()

    @classmethod
    def check(cls, cfg: Any, key: str) -> None:
        if not cfg.path:
            raise ConfigError(f"{key}.path: empty; a {cfg.kind} source needs its model folder")
        check_model_folder(cfg.path, f"{key}.path")

    @classmethod
    def describe(cls, cfg: ModelSourceConfig) -> str:
        return f"{cls.kind} {cfg.path}".strip()

    def score(self, samples: list[Sample]) -> Scores:
        with self.on_device():
            return self._score(samples)

    def _score(self, samples: list[Sample]) -> Scores:
        raise NotImplementedError


@source_kind(SRMSourceConfig)
class ScalarRMSource(ModelSource):
    """A scalar reward model (``ScalarRewardModel.save_pretrained`` folder): one value per response."""

    reads_videos = True  # its prompts are encoded with their videos (data_pipelines.records.media)

    def __init__(self, cfg: SRMSourceConfig, context: SourceContext):
        super().__init__(cfg, context)
        self.model = ScalarRewardModel.from_pretrained(cfg.path).eval().requires_grad_(False)
        self.processor = load_processor(cfg.path)

    def _score(self, samples: list[Sample]) -> Scores:
        items = [(s.prompt, media(s), s.response, s.system) for s in samples]
        c = self.cfg
        return Scores(score_responses(self.model, self.processor, items, c.micro_batch_size, c.max_length, self.device))


@source_kind(GRMSourceConfig)
class JudgeSource(ModelSource):
    """A generative judge: ``judge_mode: pointwise`` judges each response (its verdict parsed into a
    reward), ``pairwise`` compares responses (``reward_models.pairwise``); unparsable judgments are counted."""

    reads_videos = True  # its prompts are encoded with their videos (data_pipelines.records.media)

    def __init__(self, cfg: GRMSourceConfig, context: SourceContext):
        super().__init__(cfg, context)
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
        values, _ = self.grm.score([(s.prompt, media(s), s.response, s.system) for s in samples], c.micro_batch_size)
        return Scores(values, extras={"unparsable": float(self.grm.parser.n_unparsable - before)})
