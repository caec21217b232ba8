"""Held-out records over ranks, the one way every trainer splits them (``vlrft.sampling.share_over_ranks``): every
record is scored exactly once, none is left out when the count does not divide by the ranks, and every rank runs
as many items (sharded models forward and generate in lockstep). The distributed case: 5 records on 2 gloo ranks
through the eval harness, as train-policy's and train-sft's held-out evaluation call it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from launch import run_job, subprocess_env, torchrun

from vlrft.sampling import share_over_ranks

SCRIPT = Path(__file__).parent / "dist" / "heldout_share.py"


@pytest.mark.parametrize("n, world", [(5, 2), (4, 2), (1, 2), (7, 3), (0, 2), (6, 1)])
def test_every_record_is_counted_once_and_every_rank_runs_as_many(n, world):
    records = [f"r{i}" for i in range(n)]
    shares = [share_over_ranks(records, rank, world) for rank in range(world)]
    counted = [rec for share, k in shares for rec in share[:k]]
    assert sorted(counted) == sorted(records)  # each exactly once: no truncation, no double count
    assert len({len(share) for share, _ in shares}) == 1  # lockstep: the same count on every rank
    assert all(len(share) == -(-n // world) for share, _ in shares)
    assert all(pad == records[0] for share, k in shares for pad in share[k:])  # padding: a copy of a real record


@pytest.mark.distributed
def test_five_records_on_two_ranks_are_each_scored_once(tiny_model, tmp_path):
    """Under torchrun (FSDP2, 2 gloo ranks) the eval harness scores 3 records on rank 0 and 2 on rank 1 (the
    padding copy rank 1 generates is not counted), and the per-record verdicts are the single process's."""
    model = str(tiny_model("qwen2_5_vl"))
    single, dist = tmp_path / "single", tmp_path / "dist"
    res = run_job([sys.executable, str(SCRIPT), model, str(single)], env=subprocess_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    res = run_job(torchrun(str(SCRIPT), model, str(dist), "fsdp2"), env=subprocess_env(), timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    one = json.loads((single / "rank0.json").read_text())
    ranks = [json.loads((dist / f"rank{r}.json").read_text()) for r in range(2)]
    assert one["num_problems"] == 5 and [r["num_problems"] for r in ranks] == [3, 2]
    ids = [i for r in ranks for i in r["ids"]]
    assert sorted(ids) == sorted(one["ids"]) and len(ids) == 5
    assert ranks[0]["total"] == ranks[1]["total"] == 5.0  # the all-reduced count every rank reports
