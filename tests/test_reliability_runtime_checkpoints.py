"""Checkpoint integrity (issue 11, item 4): a manifest of sizes and sha256 written before COMPLETE, resume
that verifies and falls back to the previous checkpoint, explicit incomplete or damaged checkpoints
refused with their path, torn JSONL log lines dropped, pruning confined to the run's own lineage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlrft import checkpoints
from vlrft.config import load_config
from vlrft.errors import CheckpointError, KnownError
from vlrft.tracking import truncate_jsonl, truncate_run_logs
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.run import train_policy


def _ckpt(run_dir: Path, step: int, payload: bytes = b"weights") -> Path:
    """A checkpoint as the strategies write one: files into ``.tmp``, then commit_dir."""
    final = checkpoints.checkpoint_dir(run_dir / "checkpoints", step)
    tmp = checkpoints.atomic_dir(final)
    (tmp / "state.pt").write_bytes(payload * (step + 1))
    (tmp / "dcp").mkdir()
    (tmp / "dcp" / "shard0.distcp").write_bytes(b"shard" * step)
    checkpoints.commit_dir(tmp, final)
    return final


def _run(tmp_path: Path, run_id: str = "run-a") -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / checkpoints.RUN_FILE).write_text(json.dumps({"run_id": run_id}))
    return run


def test_manifest_lists_every_file_with_size_and_sha256_and_the_run_id(tmp_path):
    path = _ckpt(_run(tmp_path), 3)
    manifest = json.loads((path / checkpoints.MANIFEST).read_text())
    assert manifest["run_id"] == "run-a"
    assert sorted(manifest["files"]) == ["dcp/shard0.distcp", "state.pt"]
    assert manifest["files"]["state.pt"]["size"] == len(b"weights") * 4
    assert len(manifest["files"]["state.pt"]["sha256"]) == 64
    assert checkpoints.verify_checkpoint(path) is None


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: (p / "state.pt").write_bytes((p / "state.pt").read_bytes()[:5]), "state.pt has 5 bytes"),
        (lambda p: (p / "state.pt").write_bytes(b"x" * (p / "state.pt").stat().st_size), "does not match its sha256"),
        (lambda p: (p / "dcp" / "shard0.distcp").unlink(), "dcp/shard0.distcp is missing"),
        (lambda p: (p / checkpoints.MANIFEST).write_text("{not json"), "unreadable MANIFEST.json"),
        (lambda p: (p / "COMPLETE").unlink(), "no COMPLETE marker"),
    ],
)
def test_verify_names_what_is_damaged(tmp_path, damage, reason):
    path = _ckpt(_run(tmp_path), 2)
    damage(path)
    assert reason in checkpoints.verify_checkpoint(path)


def test_auto_resume_falls_back_to_the_previous_checkpoint_and_says_why(tmp_path):
    run = _run(tmp_path)
    _ckpt(run, 1), _ckpt(run, 2)
    newest = _ckpt(run, 3)
    (newest / "state.pt").write_bytes(b"\x00" * 10)  # torn write
    said: list[str] = []
    path = checkpoints.resume_path(run / "checkpoints", "auto", log=said.append)
    assert path.name == "step-000002"
    assert len(said) == 1 and str(newest) in said[0] and "state.pt has 10 bytes" in said[0]


def test_auto_resume_with_every_checkpoint_damaged_is_refused(tmp_path):
    run = _run(tmp_path)
    for step in (1, 2):
        (_ckpt(run, step) / "state.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no checkpoint under .* verifies"):
        checkpoints.resume_path(run / "checkpoints", "auto", log=lambda _: None)


def test_auto_resume_without_checkpoints_starts_fresh(tmp_path):
    assert checkpoints.resume_path(tmp_path / "none", "auto") is None
    assert checkpoints.resume_path(tmp_path / "none", "never") is None


def test_explicit_half_written_tmp_checkpoint_is_refused_with_its_path(tmp_path):
    run = _run(tmp_path)
    tmp = checkpoints.atomic_dir(checkpoints.checkpoint_dir(run / "checkpoints", 2))
    (tmp / "state.pt").write_bytes(b"half")
    with pytest.raises(CheckpointError) as err:
        checkpoints.resume_path(run / "checkpoints", str(tmp))
    assert f"train.resume={tmp}" in str(err.value) and "no COMPLETE marker" in str(err.value)
    assert isinstance(err.value, KnownError)


def test_explicit_damaged_or_missing_checkpoint_is_refused_with_its_path(tmp_path):
    path = _ckpt(_run(tmp_path), 4)
    (path / "state.pt").write_bytes(b"random bytes!" * 3)
    with pytest.raises(CheckpointError, match=f"train.resume={path}: cannot resume .*state.pt"):
        checkpoints.resume_path(tmp_path, str(path))
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        checkpoints.resume_path(tmp_path, str(tmp_path / "step-000009"))


def test_checkpoint_from_before_manifests_still_resumes(tmp_path):
    path = _ckpt(_run(tmp_path), 1)
    (path / checkpoints.MANIFEST).unlink()
    assert checkpoints.resume_path(tmp_path, str(path)) == path


def test_pruning_keeps_the_checkpoints_of_another_lineage(tmp_path):
    run = _run(tmp_path, "old-run")
    old = [_ckpt(run, s) for s in (7, 8)]
    (run / checkpoints.RUN_FILE).write_text(json.dumps({"run_id": "new-run"}))
    for s in (1, 2, 3):
        _ckpt(run, s)
        checkpoints.prune_checkpoints(run / "checkpoints", keep_last=2)
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert left == ["step-000002", "step-000003", "step-000007", "step-000008"]
    assert all(checkpoints.manifest_run_id(p) == "old-run" for p in old)


def test_torn_last_lines_of_the_run_logs_are_dropped_on_resume(tmp_path):
    for name in ("metrics.jsonl", "samples.jsonl", "data_order.jsonl"):
        rows = "".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3))
        (tmp_path / name).write_text(rows + '{"step": 4, "x": 0.12')  # killed mid-write
    truncate_run_logs(tmp_path, 2)
    for name in ("metrics.jsonl", "samples.jsonl", "data_order.jsonl"):
        assert [json.loads(x)["step"] for x in (tmp_path / name).read_text().splitlines()] == [1, 2]
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"st')
    truncate_jsonl(log, 5)
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_train_policy_resumes_past_a_damaged_newest_checkpoint_bitwise(tiny_model, tmp_path, capsys):
    def cfg(out: Path, steps: int):
        return load_config(
            PolicyTrainConfig,
            None,
            [
                f"model.path={tiny_model('qwen2_5_vl')}",
                f"train.output_dir={out}",
                "data.eval_source=''",
                "data.synthetic_train_size=8",
                "rollout.rollout_batch_size=2",
                "rollout.n_samples_per_prompt=2",
                "rollout.max_new_tokens=3",
                "train.micro_train_batch_size=2",
                "algorithm.entropy_coef=0.01",  # a gradient at every step, whatever the rewards
                "optim.lr=1e-3",
                f"train.max_steps={steps}",
                "train.save_every=1",
                "train.keep_last=3",
                "logging.tensorboard=false",
                "logging.wandb=disabled",
                "logging.progress_bar=false",
            ],
        )

    full, broken = tmp_path / "uninterrupted", tmp_path / "damaged"
    train_policy(cfg(full, 3))
    train_policy(cfg(broken, 2))  # stands for a run stopped after step 2
    newest = broken / "checkpoints" / "step-000002"
    state = newest / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # a torn write
    with open(broken / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/comb')  # and a torn log line
    capsys.readouterr()
    train_policy(cfg(broken, 3))
    said = capsys.readouterr()
    text = said.out + said.err
    assert f"resume: skipping checkpoint {newest}: state.pt has" in text
    assert f"resumed from {broken / 'checkpoints' / 'step-000001'} at step 1" in text
    a = (full / "final" / "model.safetensors").read_bytes()
    b = (broken / "final" / "model.safetensors").read_bytes()
    assert a == b
    steps = [json.loads(x)["step"] for x in (broken / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
