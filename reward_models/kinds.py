"""The reward source kinds, registered in one place: ``kind:`` -> the source class (which names its config).

The pool, the reward server and preflight take kinds from here and never branch on one. A new kind is one class
with its config (``reward_models.sources``: :func:`~reward_models.sources.source_kind`) and its line in
:data:`SOURCE_KINDS`; its config's keys are then what a source of that kind accepts (:data:`SOURCE_CONFIG`),
what ``--help`` lists for it and what ``--print-config`` prints.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

import torch

from reward_models.function_source import FunctionSource
from reward_models.remote_sources import HttpSource, OpenAIJudgeSource
from reward_models.sources import (
    JudgeSource,
    RewardSource,
    RewardSourceConfig,
    ScalarRMSource,
    SourceContext,
    VerifierSource,
)
from vlrft.config import ConfigError
from vlrft.config_union import TaggedUnion

SOURCE_KINDS: dict[str, type[RewardSource]] = {
    cls.kind: cls
    for cls in (VerifierSource, ScalarRMSource, JudgeSource, FunctionSource, HttpSource, OpenAIJudgeSource)
}

# a reward source's config: the dataclass of its kind (a source without ``kind:`` is a verifier)
SOURCE_CONFIG = TaggedUnion(
    "kind", {kind: cls.config for kind, cls in SOURCE_KINDS.items()}, "verifier", "reward source"
)


def make_source(
    cfg: RewardSourceConfig, device: torch.device, offload: bool, executor: Executor | None = None
) -> RewardSource:
    """The source of ``cfg``'s kind, on ``device`` (``offload``: in CPU memory between calls), scoring samples
    on ``executor``'s threads when its kind scores them concurrently."""
    return SOURCE_KINDS[cfg.kind](cfg, SourceContext(device, offload, executor))


def check_source(cfg: RewardSourceConfig, key: str) -> None:
    """The source's kind and its own rules (``key``: e.g. ``reward.sources[0]``)."""
    if cfg.kind not in SOURCE_KINDS:
        raise ConfigError(f"{key}.kind={cfg.kind}: unknown reward source kind; known: {', '.join(SOURCE_KINDS)}")
    SOURCE_KINDS[cfg.kind].check(cfg, key)


def source_config(**fields: Any) -> RewardSourceConfig:
    """The config of the kind ``fields["kind"]`` (default verifier) with ``fields`` (the keys a config file gives a
    source), typed as in a config file; a key of another kind is a :class:`~vlrft.config.ConfigError` naming the
    kind's keys."""
    return SOURCE_CONFIG.build(fields, "", lambda key: "source_config()")
