"""The reward canary of train-policy (``train.probe_every``): every k steps, the reward-hacking probes of
``reward_models.probes`` (those of ``vlrft probe-rewards``) on ``train.probe_records`` training records, through
the run's own reward pool (no model is loaded again).

Metrics: ``probe/<probe>`` the probe's mean reward over the gold answer's (text probes; left out where the gold
earns nothing), ``probe/<image probe>/<source>`` the largest change of the source's score when the image is replaced,
``probe/swap/<source>`` a pairwise judge's position bias, ``probe/flagged`` the number of probes flagged,
``time/probe``. The first time a probe is flagged, one console line names it (part of the checkpoint: a resumed run
does not say it again).

It does not change training: its records are drawn by its own generator (seeded by ``train.seed`` and the step),
every RNG the run draws from is restored after it, and its scoring calls stay out of the pool's diagnostics window.
A probe the pool cannot score (a reward source error on a made-up response) is counted in ``probe/errors``; a
probe run that fails as a whole (on the gold answers) is said once and counted there too.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable, Sequence

from reward_models.probes import run_probes
from reward_models.sources import RewardSourceError
from vlrft.strategies import rng_state, set_rng_state


def probe_metrics(report: Any) -> dict[str, float]:
    """The canary's metrics of one probe report (see the module doc)."""
    out = {"probe/flagged": float(len(report.flagged))}
    errors = sum(bool(row.error) for row in report.rows)
    if errors:
        out["probe/errors"] = float(errors)
    for row in report.rows:
        if row.source is None and row.ratio is not None and row.probe != "gold":
            out[f"probe/{row.probe}"] = row.ratio
        elif row.delta is not None:
            out[f"probe/{row.probe}/{row.source}"] = row.delta
        elif row.position_bias is not None:
            out[f"probe/swap/{row.source}"] = row.position_bias
    return out


class RewardCanary:
    def __init__(
        self, pool: Any, records: Sequence[Any], every: int, n_records: int, seed: int, log: Callable[[str], None]
    ):
        self.pool, self.records, self.every, self.n_records = pool, list(records), every, n_records
        self.seed, self.log = seed, log
        self.said: set[str] = set()  # probes already named on the console (and "error")

    def step(self, step: int) -> dict[str, float]:
        """The canary's metrics after step ``step`` (1-based): none unless the step is a multiple of ``every``."""
        if not self.every or step % self.every:
            return {}
        t0, saved = time.perf_counter(), rng_state()
        try:
            picked = random.Random(self.seed * 1_000_003 + step).sample(
                self.records, min(self.n_records, len(self.records))
            )
            report = run_probes(self.pool, picked)
        except RewardSourceError as exc:
            if "error" not in self.said:
                self.said.add("error")
                self.log(f"step {step}: reward probes failed: {exc}")
            return {"probe/errors": 1.0, "time/probe": time.perf_counter() - t0}
        finally:
            set_rng_state(saved)
        new = [r for r in report.rows if r.flagged and r.name not in self.said]
        if new:
            self.said.update(r.name for r in new)
            named = "; ".join(f"{r.name} ({r.why})" for r in new)
            self.log(
                f"step {step}: reward probes flagged: {named}: the reward pays responses that are no right answer "
                "(docs/reward-models.md, 'Probing rewards for hacks')"
            )
        return {**probe_metrics(report), "time/probe": time.perf_counter() - t0}

    def state_dict(self) -> dict:
        return {"said": sorted(self.said)}

    def load_state_dict(self, state: dict | None) -> None:
        self.said = set((state or {}).get("said", []))
