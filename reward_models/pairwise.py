"""Pairwise generative reward model: a judge shown a question and two responses names the better one.

Prompt: the system turn ``PAIRWISE_JUDGE_SYSTEM_PROMPT`` and the user turn ``PAIRWISE_JUDGE_TEMPLATE``
(``data_pipelines.formatting``) with the question's images; the verdict ``<answer>A|B|tie</answer>`` is
read by :func:`~reward_models.judgments.read_verdict` (unparsable verdicts count as ties and are counted).

Position bias: with ``debias="swap"`` every pair is judged in both orders and the two preferences are
averaged (:func:`~reward_models.judgments.swap_debiased`); ``debias="none"`` asks once, in the given order.

In the reward pool (``kind: grm``, ``judge_mode: pairwise``) the judge turns a group of rollouts into
per-sample scores (:func:`~reward_models.judgments.win_rates`):

- ``pairwise_against: group``: every pair (i, j), i < j, of the group's responses is judged (i shown as A;
  both orders with swap); a sample's score is its mean preference over the n - 1 pairs it is in: its win
  rate against the rest of the group, in [0, 1]. n(n-1)/2 judgments per group (twice with swap).
- ``pairwise_against: reference``: each response is judged against the record's reference ``answer``
  (the response shown as A); its score is its preference over the reference: 1 better, 0.5 tie, 0 worse.
"""

from __future__ import annotations

from typing import Any, Sequence

from data_pipelines.formatting import PAIRWISE_JUDGE_SYSTEM_PROMPT, PAIRWISE_JUDGE_TEMPLATE, pairwise_prompt
from data_pipelines.records import PromptRecord, media
from reward_models.judgments import preference, read_verdict, swap_debiased, win_rates

DEBIAS = ("none", "swap")
AGAINST = ("group", "reference")


class PairwiseJudge:
    """``compare(prompt, images, a, b) -> preference for a``, through a :class:`GenerativeRewardModel`'s
    ``judge`` (its model, processor and generation settings)."""

    def __init__(
        self,
        grm: Any,
        debias: str = "none",
        template: str = PAIRWISE_JUDGE_TEMPLATE,
        system: str = PAIRWISE_JUDGE_SYSTEM_PROMPT,
    ):
        if debias not in DEBIAS:
            raise ValueError(f"debias must be one of {DEBIAS}, got {debias!r}")
        self.grm, self.debias, self.template, self.system = grm, debias, template, system or None
        self.n_judged = self.n_unparsable = 0

    def verdicts(self, items: Sequence[tuple[str, list, str, str]], micro_batch_size: int = 8) -> list[str | None]:
        """Verdicts (``A``/``B``/``tie``/None) for ``(prompt, images, a, b)`` items, one judgment each."""
        judge_items = [(pairwise_prompt(p, a, b, self.template), ims, self.system) for p, ims, a, b in items]
        texts = self.grm.judge(judge_items, micro_batch_size) if judge_items else []
        out = [read_verdict(t, "pairwise")[0] for t in texts]
        self.n_judged += len(out)
        self.n_unparsable += sum(v is None for v in out)
        return out

    def compare(self, items: Sequence[tuple[str, list, str, str]], micro_batch_size: int = 8) -> list[float]:
        """Preference for ``a`` over ``b`` of each item (swap-debiased when configured)."""
        ab = [preference(v) for v in self.verdicts(items, micro_batch_size)]
        if self.debias == "none":
            return ab
        ba = [preference(v) for v in self.verdicts([(p, ims, b, a) for p, ims, a, b in items], micro_batch_size)]
        return swap_debiased(ab, ba)

    def score(
        self, records: Sequence[PromptRecord], responses: Sequence[str], against: str, micro_batch_size: int = 8
    ) -> list[float]:
        """Per-sample scores of the samples (record, response); a group is a run of samples of one record."""
        if against not in AGAINST:
            raise ValueError(f"pairwise_against must be one of {AGAINST}, got {against!r}")
        if against == "reference":
            missing = [r.id for r in records if not r.answer]
            if missing:
                raise ValueError(f"pairwise_against: reference needs the records' answer; missing for {missing[:3]}")
            items = [(r.prompt, media(r), resp, r.answer) for r, resp in zip(records, responses)]
            return self.compare(items, micro_batch_size)
        groups: list[list[int]] = []
        for i, rec in enumerate(records):
            if i and rec.id == records[i - 1].id:
                groups[-1].append(i)
            else:
                groups.append([i])
        pairs = [(g[x], g[y]) for g in groups for x in range(len(g)) for y in range(x + 1, len(g))]
        prefs = self.compare(
            [(records[i].prompt, media(records[i]), responses[i], responses[j]) for i, j in pairs], micro_batch_size
        )
        scores = [0.5] * len(records)
        for g in groups:
            local = {(g.index(i), g.index(j)): p for (i, j), p in zip(pairs, prefs) if i in g}
            for k, s in zip(g, win_rates(len(g), local)):
                scores[k] = s
        return scores
