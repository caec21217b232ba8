"""What a policy run that goes wrong keeps (issue 64, item 6; ``vlrft/outcome.py``): ``train.on_collapse: stop`` ends a
sustained collapse in one line with exit code 2, ``rollback`` goes back to the checkpoint before it with a lower
learning rate, at most ``train.max_rollbacks`` times; ``best/`` keeps the best held-out model either way.

The collapse is real and quick: a policy sampled at temperature 1e-5 is all but greedy, so a tiny random model gives
one answer to most images (75-88% of the 8 distinct prompts, the references' most common covers 38%) and every
group of 4 is all wrong: no advantage left. The accuracy source is a reward function (``always_red``), whose answer
the detectors read as the response's text. ``train.collapse_share=0.5`` and ``collapse_steps=2`` make the alarm
start after two such steps (the learning proof with the default thresholds: tests/test_policy_rollback.py)."""

from __future__ import annotations

import json
from pathlib import Path

from launch import QUIET

from vlrft.cli import main


def _args(tmp_path: Path, model: Path, out: Path, *extra: str) -> list[str]:
    fn = tmp_path / "always_red.py"
    fn.write_text("def score(sample):\n    return float(sample.response.strip().lower() == 'red')\n")
    return [
        "train-policy",
        f"model.path={model}",
        f"reward.sources=[{{name: red, kind: function, function: {fn}:score}}]",
        "reward.accuracy_source=red",
        "rollout.rollout_batch_size=8",
        "rollout.n_samples_per_prompt=4",
        "data.synthetic_eval_size=8",
        "train.collapse_share=0.5",
        "train.collapse_steps=2",
        "train.save_every=1",
        "train.keep_last=5",
        "optim.lr=1e-3",
        "optim.lr_scheduler=constant",
        f"train.output_dir={out}",
        *QUIET,
        *extra,
    ]


def _steps(out: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]


def test_on_collapse_stop_ends_the_run_in_one_line_keeping_best_and_checkpoints(tiny_model, tmp_path, capsys):
    out = tmp_path / "stop"
    cold = ["rollout.temperature=1e-5", "train.max_steps=6", "train.on_collapse=stop"]
    assert main(_args(tmp_path, tiny_model("qwen2_5_vl"), out, *cold)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "vlrft train-policy: collapse error: step 2: a sustained answer collapse since step 1; train.on_collapse=stop "
        "ended the run; best/ holds step 0 (accuracy 0)"
    ), err
    assert not (out / "final").exists() and (out / "best" / "model.safetensors").is_file()
    assert json.loads((out / "best" / "best.json").read_text()) == {"step": 0, "metric": "accuracy", "value": 0.0}
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]
    assert _steps(out) == [1, 2]


def test_on_collapse_rollback_restores_the_checkpoint_before_it_lowers_the_lr_and_stops_after_max_rollbacks(
    tiny_model, tmp_path, capsys
):
    out, model = tmp_path / "rollback", tiny_model("qwen2_5_vl")
    assert main(_args(tmp_path, model, out, "train.max_steps=2")) == 0  # two healthy steps, checkpoints 1 and 2
    capsys.readouterr()
    cold = ["rollout.temperature=1e-5", "train.max_steps=8", "train.resume_changes=allow"]
    rollback = ["train.on_collapse=rollback", "train.max_rollbacks=1", "train.collapse_lr_factor=0.25"]
    assert main(_args(tmp_path, model, out, *cold, *rollback)) == 2
    got = capsys.readouterr()
    said = [line for line in got.out.splitlines() if "rollback 1 of 1" in line]
    assert said == [
        "step 4: a sustained answer collapse since step 3: rollback 1 of 1 to step-000002, learning rate x0.25 -> "
        "0.00025 (train.on_collapse=rollback)"
    ], got.out
    assert (
        got.err.strip()
        .splitlines()[-1]
        .startswith(
            "vlrft train-policy: collapse error: step 4: a sustained answer collapse since step 3, after 1 rollbacks "
            "(train.max_rollbacks); best/ holds step 0"
        )
    ), got.err
    # the rolled-back steps were redone: each step once in the log, with the lowered learning rate after step 2
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train/lr" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[1]["train/lr"] == 1e-3 and abs(rows[2]["train/lr"] - 2.5e-4) < 1e-12, rows
    assert json.loads((out / "final" / "summary.json").read_text())["steps"] == 2  # the healthy run's export, kept


def test_a_rollback_never_restores_a_checkpoint_an_earlier_rollback_restored(tmp_path):
    """The target is the newest complete checkpoint before the collapse began; one already restored (which collapsed
    again) is passed over for the one before it (measured on an Intel Xeon: restoring step 60 twice collapsed twice,
    docs/train-policy.md)."""
    from types import SimpleNamespace

    from vlrft.checkpoints import checkpoint_dir
    from vlrft.outcome import CollapsePolicy

    complete = [checkpoint_dir(tmp_path, s) for s in (40, 50, 60, 70)]
    policy = CollapsePolicy(SimpleNamespace(on_collapse="rollback"))
    assert policy.target(complete, 65) == complete[2]  # step 60
    policy.rollbacks.append({"at_step": 69, "collapse_from": 65, "to_step": 60})
    assert policy.target(complete, 70) == complete[1]  # not 60 again: 50
    assert policy.target(complete, 75) == complete[3]  # a newer checkpoint was never restored: 70
    policy.rollbacks.append({"at_step": 74, "collapse_from": 70, "to_step": 50})
    assert policy.target(complete, 62) == complete[0] and policy.target(complete, 45) == complete[0]
    assert policy.target(complete, 40) is None
