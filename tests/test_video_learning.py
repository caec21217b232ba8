"""Learning proof of the video path (issue 61): on the dot-motion task (``data_pipelines.synthetic_video``: does the
dot move left or right; the first frame has the same distribution for both answers), a tiny random Qwen2.5-VL learns
from real mp4 files with train-sft to >= 0.9 held-out greedy accuracy, GRPO from it stays >= 0.9 at every evaluation
(no collapse), and the same pipeline given only each video's first frame (a one-frame video) stays within 0.1 of
chance at every evaluation: the motion is what is learned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import QUIET

from data_pipelines.synthetic_video import make_dot_motion_records
from data_pipelines.video import iter_frames
from vlrft.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# 4 frames at 2 fps (all sampled: two temporal grids), a dot of radius 10 moving 6 px a frame, frames sized to
# 56x56 (4 tokens a grid). (With radius 6 the tiny model learnt on one seed in three: a plateau at chance.)
DOTS = {"frames": 4, "fps": 2, "step": 6, "radius": 10}
VIDEO = ["data.video_min_pixels=3136", "data.video_max_pixels=4096"]
SFT = ["optim.lr=1e-3", "train.max_steps=300", "train.batch_size=16", "train.eval_every=100"]
RL = ["rollout.max_new_tokens=4", "rollout.n_samples_per_prompt=8", "rollout.rollout_batch_size=8", "optim.lr=1e-4"]
RL += ["train.max_steps=40", "train.eval_every=10"]


def _records(root: Path, n: int, seed: int, first_frame: bool) -> Path:
    """``n`` dot-motion records as a JSONL of mp4 paths, or (``first_frame``) of each video's first frame alone."""
    rows = []
    for r in make_dot_motion_records(n, root / f"videos-{seed}", seed=seed, **DOTS):
        if first_frame:
            png = Path(r["videos"][0]).with_suffix(".png")
            next(iter_frames(r["videos"][0], [0])).save(png)
            r = {**r, "videos": [[str(png)]]}
        rows.append(r)
    path = root / f"records-{seed}{'-first' if first_frame else ''}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _accuracy(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}


def test_dot_motion_is_learned_from_the_videos_and_not_from_one_frame(tmp_path):
    curves = {}
    for first in (False, True):
        train, held = _records(tmp_path, 256, 0, first), _records(tmp_path, 64, 10_000, first)
        sft = tmp_path / ("sft-first-frame" if first else "sft")
        data = [f"data.train_source={train}", f"data.eval_source={held}", *VIDEO, *QUIET]
        assert main(["train-sft", f"train.output_dir={sft}", *SFT, *data]) == 0
        curves["first frame" if first else "sft"] = _accuracy(sft)
        if not first:
            rl = tmp_path / "grpo"
            assert main(["train-policy", f"model.path={sft / 'final'}", f"train.output_dir={rl}", *RL, *data]) == 0
            curves["grpo"] = _accuracy(rl)
    for name, curve in curves.items():
        print(f"{name}: held-out greedy accuracy " + ", ".join(f"{acc:.3f} at {s}" for s, acc in curve.items()))
    sft, grpo, control = curves["sft"], curves["grpo"], curves["first frame"]
    assert sft[0] <= 0.1 and sft[200] >= 0.9 and sft[300] >= 0.9
    assert list(grpo) == [0, 10, 20, 30, 40] and min(grpo.values()) >= 0.9
    assert all(abs(acc - 0.5) <= 0.1 for step, acc in control.items() if step > 0)
