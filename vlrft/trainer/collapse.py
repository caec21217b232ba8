"""The collapse detectors of ``train-policy`` (``reward_models.diagnostics``: group outcomes, the spread of the
answers over distinct prompts, the alarm), fed every step with the rollout batch of every rank.

The answer of a response is what the accuracy source's verifier extracts from it (``vocab_answer``: the answer
word; ``math_boxed``: the boxed expression), normalised; a verifier that extracts nothing it can name (a reward
function) or would cost a call per sample (a served source's, ``kind: http``) says ``extracts = False``, and the
normalised response itself (its first 64 characters) is the answer.

The alarm (``alarm/answer_collapse``) is a collapse the run does not leave by itself, in one of two signatures:

1. for ``train.collapse_steps`` steps in a row, one answer covers more than ``train.collapse_share`` of the distinct
   prompts while the reference answers vary, AND every group of every rank is all right or all wrong: every
   group-relative advantage is zero and the policy gradient has nothing to climb;
2. at ``train.collapse_evals`` held-out evaluations in a row, the greedy answers collapsed the same way, and the
   held-out accuracy did not rise over them (a policy that learns junk its reward pays: groups mixed by the junk,
   held-out at chance).

A policy that passes through a one-answer phase on its way to learning keeps groups with mixed outcomes and leaves
it within three evaluations, and stays quiet: the showcase run (one answer for 100% of the prompts at steps 33-60,
12-100% of its groups mixed, held-out 0.25, 0.25, then 0.75 at steps 25, 50, 75) and the yes/no proof from scratch
(one word to every image, held-out 0.5 at steps 25, 50 and 75, then 1.0 from step 100). The alarm is said once on the
console when it starts; its state is part of the checkpoint, so a resumed run logs what an uninterrupted one would.
``train.on_collapse`` decides what else happens (``vlrft.outcome``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from reward_models.diagnostics import answer_collapse, answer_spread, group_outcomes
from reward_models.math_answers import normalize_text


def answer_of(verifier: Any, text: str, record: Any) -> str | None:
    """The answer ``verifier`` reads in ``text`` for ``record`` (normalised), or None when it finds none."""
    if not getattr(verifier, "extracts", True):
        return " ".join(text.lower().split())[:64] or None
    try:
        extracted = verifier(text, record.answer, **record.metadata).extracted
    except (ValueError, TypeError):  # a record the verifier cannot judge (counted by the pool already)
        return None
    return normalize_text(str(extracted)) if extracted is not None else None


class CollapseMonitor:
    def __init__(
        self, verifier: Any, share: float, steps: int, strategy: Any, log: Callable[[str], None], evals: int = 4
    ):
        self.verifier, self.share, self.steps, self.strategy, self.log = verifier, share, steps, strategy, log
        self.run = 0  # consecutive steps with one answer for more than ``share`` of the prompts and no mixed group
        self.needed = evals  # held-out evaluations in a row that make the other signature
        self.evals: list[tuple[int, bool, float]] = []  # the last ones: (step, answers collapsed, accuracy)

    @classmethod
    def for_run(cls, verifier: Any, train: Any, strategy: Any, log: Callable[[str], None]) -> CollapseMonitor:
        """The monitor of a run's ``train`` section (``collapse_share``, ``collapse_steps``, ``collapse_evals``)."""
        return cls(verifier, train.collapse_share, train.collapse_steps, strategy, log, train.collapse_evals)

    def step(self, step: int, groups: Sequence[Any], correct: torch.Tensor, group_ids: torch.Tensor) -> dict:
        """The detectors' metrics for this step's scored groups (every rank gets the same answer-spread figures)."""
        out = group_outcomes(correct.tolist(), group_ids.tolist())
        mine = [
            (g.record.id, answer_of(self.verifier, r.text, g.record), g.record.answer)
            for g in groups
            for r in g.rollouts
        ]
        everyone = [row for part in self.strategy.all_gather_object(mine) for row in part]
        spread, top = answer_spread(*zip(*everyone)) if everyone else ({}, None)
        out.update(spread)
        flat = out["groups/all_wrong"] + out["groups/all_right"] >= 1.0 - 1e-9  # no group with mixed outcomes
        flat = all(self.strategy.all_gather_object(flat))
        if spread and flat and answer_collapse(spread, self.share):
            self.run += 1
        else:
            self.run = 0
        out["alarm/answer_collapse"] = float(self.start(step) is not None)
        if self.run == self.steps:
            self.log(
                f"step {step}: alarm: answer collapse: {top!r} is the answer to "
                f"{spread['answers/top_share']:.0%} of the distinct prompts for {self.steps} steps while the reference "
                f"answers vary (the most common covers {spread['answers/gold_top_share']:.0%}) and no group has mixed "
                "outcomes, so no advantage is left to learn from; the policy may answer without reading the prompt or "
                "the image (docs/train-policy.md, 'Reading the collapse detectors'; train.on_collapse)"
            )
        return out

    def heldout(self, step: int, metrics: dict) -> None:
        """Take a held-out evaluation (its ``answers/*`` figures and ``accuracy``, after step ``step``): the other
        signature is ``train.collapse_evals`` evaluations in a row whose greedy answers collapsed onto one while the
        held-out accuracy did not rise over them."""
        if "answers/top_share" not in metrics:
            return
        collapsed = answer_collapse(metrics, self.share)
        was = self._stalled()
        self.evals = [*self.evals, (step, collapsed, float(metrics.get("accuracy", 0.0)))][-self.needed :]
        if self._stalled() and not was:
            steps = ", ".join(str(s) for s, _, _ in self.evals)
            self.log(
                f"step {step}: alarm: answer collapse: the held-out answers were one answer for more than "
                f"{self.share:.0%} of the prompts at {self.needed} evaluations in a row (steps {steps}) while the "
                f"held-out accuracy did not rise ({self.evals[0][2]:.3g} -> {self.evals[-1][2]:.3g}); the policy may "
                "answer without reading the prompt or the image (docs/train-policy.md, 'Reading the collapse "
                "detectors'; train.on_collapse)"
            )

    def _stalled(self) -> bool:
        e = self.evals
        return len(e) == self.needed and all(c for _, c, _ in e) and e[-1][2] <= e[0][2]

    def start(self, step: int) -> int | None:
        """The first step of the sustained collapse holding after ``step``, or None: of the steps without a mixed
        group, or the first of the held-out evaluations that stalled."""
        begins = []
        if self.run >= self.steps:
            begins.append(step - self.run + 1)
        if self._stalled():
            begins.append(max(1, self.evals[0][0]))
        return min(begins) if begins else None

    def state_dict(self) -> dict:
        return {"run": self.run, "evals": list(self.evals)}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.run = state.get("run", 0)
        self.evals = [tuple(e) for e in state.get("evals", [])]
