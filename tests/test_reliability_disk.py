"""A disk that refuses a write (issue 23, item 7 and its disk-full export case): a checkpoint or an export
that cannot be written is one line naming what, why and what is intact; nothing half-written stays, and the
same command continues once there is room.

The refusal is real: the run's process gets a file-size limit (``RLIMIT_FSIZE``, what ``ulimit -f`` sets)
below the size of the file it must write, with ``SIGXFSZ`` ignored so that the write fails with ``EFBIG``
as a full disk fails with ``ENOSPC`` (``vlrft.checkpoints.storage_failure`` treats the two alike; a
tmpfs would need root to mount)."""

from __future__ import annotations

import json
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from launch import QUIET, subprocess_env

from vlrft import checkpoints
from vlrft.cli import main as vlrft_main
from vlrft.errors import ModelFolderError
from vlrft.models.loading import load_model


def _sft(model: Path, out: Path, *extra: str, limit: int | None = None) -> subprocess.CompletedProcess:
    """``vlrft train-sft`` in its own interpreter, with files limited to ``limit`` bytes when given."""

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    args = [sys.executable, "-m", "vlrft", "train-sft", f"model.path={model}", f"train.output_dir={out}"]
    args += ["data.synthetic_train_size=16", "data.synthetic_eval_size=4", "train.batch_size=4", *QUIET, *extra]
    return subprocess.run(
        args, env=subprocess_env(), capture_output=True, text=True, preexec_fn=limited if limit else None
    )


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("vlrft train-sft: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_checkpoint_the_disk_refuses_is_one_line_and_leaves_nothing_half_written(tiny_model, tmp_path):
    model = tiny_model("qwen2_5_vl")
    weights = (model / "model.safetensors").stat().st_size  # the checkpoint holds these and Adam's two moments
    out = tmp_path / "run"
    proc = _sft(model, out, "train.max_steps=4", "train.save_every=2", limit=weights)
    line = _one_line(proc)
    step2 = checkpoints.checkpoint_dir(out / "checkpoints", 2)
    # torch.save's writer loses the errno and reports its short write (nothing more precise can be said)
    assert line.startswith(f"vlrft train-sft: storage error: checkpoint {step2}: not written: a short write ("), line
    assert f"files limited to {weights} bytes by ulimit -f" in line
    assert "no earlier checkpoint exists; free space (or lower train.keep_last) and run the same command again" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == []  # step-000002.tmp removed
    assert not (out / "LOCK").exists() and not (out / "final").exists()
    # with room again, the same command runs to the end
    again = _sft(model, out, "train.max_steps=4", "train.save_every=2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


def test_an_export_the_disk_refuses_keeps_the_old_final_consistent_and_the_rerun_exports(tiny_model, tmp_path):
    """The state a full disk leaves between the last checkpoint and the export: ``final/`` (and the run's
    ``summary.json``) from an earlier, shorter schedule, the new schedule's last checkpoint complete."""
    model = tiny_model("qwen2_5_vl")
    out, kept = tmp_path / "run", tmp_path / "kept"
    assert _sft(model, out, "train.max_steps=2").returncode == 0
    kept.mkdir()
    for name in ("final", "summary.json"):  # the run as it stood after 2 steps
        (shutil.copytree if (out / name).is_dir() else shutil.copy2)(out / name, kept / name)
    assert _sft(model, out, "train.max_steps=4").returncode == 0  # continues to 4 and exports
    longer = _files(out / "final")
    for name in ("final", "summary.json"):  # as if the export after step 4 had not happened
        checkpoints.remove_path(out / name)
        (shutil.copytree if (kept / name).is_dir() else shutil.copy2)(kept / name, out / name)
    before = _files(out / "final")

    weights = (out / "final" / "model.safetensors").stat().st_size
    line = _one_line(_sft(model, out, "train.max_steps=4", limit=weights // 2))
    step4 = checkpoints.checkpoint_dir(out / "checkpoints", 4)
    assert line.startswith(
        f"vlrft train-sft: storage error: final model {out / 'final'}: not written: File too large ("
    ), line
    assert line.endswith(
        f"{out / 'final'} still holds the model of step 2, as its summary.json says; checkpoint {step4} is complete: "
        "free space and run the same command again to export it"
    ), line
    assert _files(out / "final") == before  # the old export, whole
    assert json.loads((out / "final" / "summary.json").read_text())["steps"] == 2
    assert json.loads((out / "summary.json").read_text())["steps"] == 2  # the run folder says the same
    assert not (out / "final.tmp").exists() and not (out / "LOCK").exists()
    manifest = json.loads((out / "final" / checkpoints.MANIFEST).read_text())["files"]
    assert set(manifest) == set(before) - {checkpoints.MANIFEST}

    again = _sft(model, out, "train.max_steps=4")  # room again: resumes at the end and exports
    assert again.returncode == 0, again.stderr[-3000:]
    now = _files(out / "final")
    assert now["model.safetensors"] == longer["model.safetensors"]  # bitwise the 4-step model
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


def _damaged_copy(model: Path, folder: Path, cut: int) -> Path:
    """A copy of ``model`` whose ``model.safetensors`` lost its last ``cut`` bytes (a copy cut off)."""
    shutil.copytree(model, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-cut])
    return folder


def test_a_truncated_safetensors_file_is_one_line_in_train_and_eval(tiny_model, tmp_path, capsys):
    """Issue 23, item 7: a truncated ``model.safetensors`` was a traceback from deep inside the loader."""
    model = tiny_model("qwen2_5_vl")
    capsys.readouterr()  # what building the tiny model printed
    size = (model / "model.safetensors").stat().st_size
    cut = _damaged_copy(model, tmp_path / "cut", 1000)
    why = f"model.safetensors holds {size - 1000} bytes but its header describes {size}: truncated"
    out = tmp_path / "run"
    assert vlrft_main(["train-policy", f"model.path={cut}", f"train.output_dir={out}", *QUIET]) == 2
    err = capsys.readouterr().err
    assert (
        err == f"vlrft train-policy: config error: model.path={cut}: {why} (an interrupted copy or export?); "
        "copy the model again or export it again\n"
    )
    assert not out.exists()  # refused before the folder was written
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"id": "q1", "prompt": "What colour?", "answer": "red"}) + "\n")
    args = ["eval", "--benchmark", "colors", "--verifier", "exact_match", "--model", str(cut), "--data", str(data)]
    assert vlrft_main([*args, "--out", str(tmp_path / "ev"), "--no-progress"]) == 2
    assert f"--model={cut}: {why}" in capsys.readouterr().err
    # the one loader says the same to any other caller (a reward source, a critic, Python code)
    with pytest.raises(ModelFolderError, match=f"{cut}: {why}"):
        load_model(cut)
    header = _damaged_copy(model, tmp_path / "head", size - 4)  # not even the header's length is left
    with pytest.raises(ModelFolderError, match="model.safetensors \\(4 bytes\\) is truncated or not a safetensors"):
        load_model(header)
