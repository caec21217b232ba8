"""``train.overwrite=true`` clears only a run folder of its own (issue 23): never the current directory or one of
its parents, never a folder holding the run's model, data or config files, never a folder without ``RUN.json``;
an empty ``train.output_dir`` (an unset shell variable) is a config error. Each refusal is one line (exit code 2
through the CLI) and leaves every file where it was, byte for byte."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from launch import QUIET

from vlrft import checkpoints
from vlrft.cli import main
from vlrft.config import ConfigError, input_paths, load_config
from vlrft.errors import RunFolderError
from vlrft.run_folder import LOCK, WRITE_CHECK, claim
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.supervised_config import SFTTrainConfig
from vlrft.trainer.supervised_run import train_sft


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _run_folder(folder: Path) -> Path:
    """A folder written by an earlier vlrft run (RUN.json and outputs): overwrite could clear it but for the rule
    under test."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / checkpoints.RUN_FILE).write_text('{"run_id": "old"}\n')
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    return folder


def _refused(capsys, argv: list[str], *expected: str) -> str:
    """``vlrft train-sft ARGV train.overwrite=true`` exits 2 with one line on stderr containing ``expected``."""
    capsys.readouterr()  # what came before (a fixture's progress bars)
    assert main(["train-sft", *argv, "train.overwrite=true", *QUIET]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    for text in expected:
        assert text in err, err
    return err


def test_the_current_directory_is_never_cleared(tmp_path, monkeypatch, capsys):
    here = _run_folder(tmp_path / "here")
    before = _files(here)
    monkeypatch.chdir(here)
    _refused(capsys, ["train.output_dir=."], "run folder error", "train.output_dir=.: is the current directory")
    assert _files(here) == before


def test_a_parent_of_the_current_directory_is_never_cleared(tmp_path, monkeypatch, capsys):
    run = _run_folder(tmp_path / "run")
    (run / "sub").mkdir()
    (run / "sub" / "notes.txt").write_text("mine")
    before = _files(run)
    monkeypatch.chdir(run / "sub")
    _refused(capsys, [f"train.output_dir={run}"], f"train.output_dir={run}: is a parent of the current directory")
    assert _files(run) == before


def test_the_model_folder_is_never_cleared(tmp_path, tiny_model, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model("qwen2_5_vl"), model)
    before = _files(model)
    args = [f"model.path={model}", f"train.output_dir={model}"]
    _refused(capsys, args, f"train.output_dir={model}: holds model.path={model}", "train.overwrite=true")
    assert _files(model) == before
    # the driver refuses it too (a run started from Python, not the command line), before writing its LOCK
    cfg = load_config(SFTTrainConfig, None, [*args, "train.overwrite=true", "data.eval_source=''", *QUIET])
    with pytest.raises(RunFolderError, match="holds model.path="):
        train_sft(cfg)
    assert _files(model) == before and not (model / LOCK).exists()


@pytest.mark.parametrize("where", ["file inside", "the folder itself"])
def test_a_folder_holding_the_data_is_never_cleared(tmp_path, capsys, where):
    run = _run_folder(tmp_path / "run")
    (run / "data").mkdir()
    (run / "data" / "train.jsonl").write_text('{"messages": []}\n')
    data = run / "data" / "train.jsonl" if where == "file inside" else run
    before = _files(run)
    key = "data.train_source" if where == "file inside" else "data.eval_source"
    _refused(capsys, [f"train.output_dir={run}", f"{key}={data}"], f"holds {key}={data}")
    assert _files(run) == before


def test_a_folder_holding_the_config_file_is_never_cleared(tmp_path, capsys):
    run = _run_folder(tmp_path / "run")
    config = run / "config.yaml"  # e.g. re-running from the config a run wrote
    config.write_text(f"train:\n  output_dir: {run}\n")
    before = _files(run)
    _refused(capsys, [str(config)], f"train.output_dir={run}: holds config file={config}")
    assert _files(run) == before


def test_a_folder_vlrft_did_not_write_is_never_cleared(tmp_path, capsys):
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("\\chapter{One}")
    before = _files(mine)
    _refused(capsys, [f"train.output_dir={mine}"], "no RUN.json: it does not look like a vlrft run folder")
    assert _files(mine) == before


def test_another_ranks_write_check_is_not_another_runs_output(tmp_path):
    # every rank's preflight tries a folder in train.output_dir (made and removed at once) while rank 0 claims it:
    # a torchrun run once refused its own fresh folder for a trial folder of another rank (CI, stop 78)
    out = tmp_path / "run"
    out.mkdir()
    trial = tempfile.mkdtemp(prefix=WRITE_CHECK, dir=out)  # the other rank's trial, not yet removed
    run = claim(out, "auto", False, log=lambda _: None)
    assert json.loads((out / checkpoints.RUN_FILE).read_text())["run_id"] == run
    assert sorted(p.name for p in out.iterdir()) == sorted([checkpoints.RUN_FILE, Path(trial).name])


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_output_dir_is_a_config_error(tmp_path, monkeypatch, capsys, value):
    here = _run_folder(tmp_path / "here")
    before = _files(here)
    monkeypatch.chdir(here)
    _refused(capsys, [f"train.output_dir={value}"], "config error", "'train'", f"output_dir={value!r} is empty")
    assert _files(here) == before
    for schema in (SFTTrainConfig, PolicyTrainConfig):  # every trainer's train section is a RunConfig
        with pytest.raises(ConfigError, match="output_dir='' is empty"):
            load_config(schema, None, ["train.output_dir="])


def test_every_input_path_of_the_config_is_protected():
    cfg = load_config(
        PolicyTrainConfig,
        None,
        [
            "model.path=/m",
            "data.train_source=/d/train.jsonl",
            "data.eval_source=''",
            "critic.path=/c",
            "reward.sources=[{name: rm, kind: srm, path: /r}]",
            "reward.accuracy_source=''",
        ],
    )
    assert input_paths(cfg) == [
        ("model.path", "/m"),
        ("data.train_source", "/d/train.jsonl"),
        ("reward.sources[0].path", "/r"),
        ("critic.path", "/c"),
    ]
