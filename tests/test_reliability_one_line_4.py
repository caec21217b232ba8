"""One line for each failure, fourth pass (issue 64): learning rates and temperatures that are not numbers a run can
use, ``vlrft eval`` given a model or an ``--out`` it cannot use, ``eval-reward-model``'s sizes and ``--out``, a run
folder at the filesystem root or the home folder, ``train.overwrite`` next to a user's own files, a damaged
``metrics.jsonl`` at the end of a run, a tiny model at a real model's learning rate, and record fields vlrft does not
read. Each refusal is one line on stderr and exit code 2 before anything loads, and leaves the disk as it was."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch import QUIET

from data_pipelines.readers import read_records
from reward_models.config import RewardModelTrainConfig
from vlrft import checkpoints
from vlrft.cli import main
from vlrft.config import load_config
from vlrft.run_folder import LOCK, RUN_OUTPUTS, run_in_folder
from vlrft.strategies import StrategyConfig, make_strategy
from vlrft.summary import write_summary
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.preflight import DEMOS, learning_rate_warning, start_warnings
from vlrft.trainer.supervised_config import DPOTrainConfig, SFTTrainConfig

REPO = Path(__file__).resolve().parents[1]


def _one_line(capsys) -> str:
    """The whole of stderr, which must be one line."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    return err.rstrip("\n")


def _files(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


# -- item 1: optim.lr, every trainer -----------------------------------------------------------------
@pytest.mark.parametrize("command", ["train-policy", "train-sft", "train-dpo", "train-reward-model"])
@pytest.mark.parametrize("value, rule", [("-1", "-1.0: must be > 0"), ("nan", "nan: not finite; must be > 0")])
def test_a_negative_or_nan_learning_rate_is_refused_at_load_by_every_trainer(tmp_path, capsys, command, value, rule):
    """Issue 64, item 1: ``optim.lr=-1`` and ``optim.lr=nan`` were accepted (the optimizer section is shared by all
    four trainers, so was the gap); now refused by the config's own range, before a run folder exists."""
    capsys.readouterr()
    out = tmp_path / "run"
    assert main([command, f"optim.lr={value}", f"train.output_dir={out}", *QUIET]) == 2
    assert _one_line(capsys) == f"vlrft {command}: config error: optim.lr={rule}"
    assert not out.exists()


# -- item 2: infinities say so ------------------------------------------------------------------------
def test_an_infinite_temperature_is_refused_as_not_finite(tmp_path, capsys):
    """Issue 64, item 2: ``rollout.temperature=inf`` was refused as "must be > 0", which inf is; ``vlrft eval
    --temperature inf`` was accepted (inf >= 0)."""
    capsys.readouterr()
    out = tmp_path / "run"
    assert main(["train-policy", "rollout.temperature=inf", f"train.output_dir={out}"]) == 2
    assert _one_line(capsys) == (
        "vlrft train-policy: config error: rollout.temperature=inf: not finite; must be > 0 for training"
    )
    evaluation = ["eval", "--benchmark", "gsm8k", "--model", "m", "--data", "d", "--out", str(out)]
    assert main([*evaluation, "--top-p", "inf"]) == 2
    assert _one_line(capsys) == "vlrft eval: config error: --top-p inf: not finite; must be > 0 and <= 1"
    assert main([*evaluation, "--temperature", "inf"]) == 2
    assert _one_line(capsys) == "vlrft eval: config error: --temperature inf: not finite; must be >= 0 (0: greedy)"
    assert not out.exists()


# -- item 3: eval's model, as train-policy says it -----------------------------------------------------
def _eval(model: str, out: Path, *extra: str) -> list[str]:
    data = ["--data", str(REPO / "no-such-data.jsonl")]  # never read: each refusal comes first
    return ["eval", "--benchmark", "mine", "--verifier", "exact_match", "--model", model, *data, "--out", str(out)]


def test_eval_names_a_missing_model_folder_and_an_uncached_hub_id(tmp_path, capsys, monkeypatch):
    """Issue 64, item 3: ``--model ./missing`` was the hub's "Repo id must use alphanumeric chars" traceback online
    and "hub ids need the network" offline; now the words of train-policy's preflight (the same check)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()
    assert main(_eval("./missing", tmp_path / "e")) == 2
    assert _one_line(capsys) == "vlrft eval: config error: --model=./missing: no such folder"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # a local path is never taken for a hub id, online either
    assert main(_eval("./missing", tmp_path / "e")) == 2
    assert _one_line(capsys) == "vlrft eval: config error: --model=./missing: no such folder"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(_eval("nobody-vlrft/no-such-model", tmp_path / "e")) == 2
    assert _one_line(capsys) == (
        "vlrft eval: config error: --model=nobody-vlrft/no-such-model: no such folder, and as a hub id it is not in "
        "the local cache (HF_HUB_OFFLINE is set)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no --out folder made


# -- items 4 and 5: eval's --out, eval-reward-model's sizes and --out ---------------------------------------
def _unwritable(tmp_path: Path) -> tuple[Path, str]:
    """A folder this process cannot write in, and the reason the system gives: a folder without write permission,
    or for root (whom permissions do not stop) /sys, where no folder can be made."""
    if os.geteuid() == 0:
        return Path("/sys"), "Operation not permitted"
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    return folder, "Permission denied"


def test_eval_out_at_a_file_under_a_file_or_unwritable_is_one_line_before_the_model(tmp_path, capsys):
    """Issue 64, item 4: each was a traceback after the model had loaded (FileExistsError, NotADirectoryError,
    PermissionError); the model here does not exist, so nothing past the check ran."""
    capsys.readouterr()
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert main(_eval("./missing", notes)) == 2
    assert _one_line(capsys) == f"vlrft eval: config error: --out {notes}: is a file, not a folder"
    assert main(_eval("./missing", notes / "e")) == 2
    assert _one_line(capsys) == (
        f"vlrft eval: config error: --out {notes / 'e'}: {notes} is a file, so nothing can be written under it; "
        "choose another --out"
    )
    locked, why = _unwritable(tmp_path)
    assert main(_eval("./missing", locked / "e")) == 2
    assert _one_line(capsys) == (
        f"vlrft eval: config error: --out {locked / 'e'}: {locked} is not writable ({why}); choose another --out"
    )
    assert notes.read_text() == "mine" and not (locked / "e").exists()
    assert main(_eval("./missing", Path("/"))) == 2
    assert _one_line(capsys).startswith("vlrft eval: config error: --out /: is the filesystem root, never an output")


@pytest.mark.parametrize(
    "args, line",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
        (["--batch-size", "0"], "--batch-size 0: must be >= 1"),
        (["--synthetic-size", "0"], "--synthetic-size 0: must be >= 1"),
    ],
)
def test_eval_reward_model_refuses_zero_sizes(tmp_path, capsys, args, line):
    """Issue 64, item 5: a batch size of 0 looped forever or divided by zero after the model loaded."""
    capsys.readouterr()
    assert main(["eval-reward-model", str(tmp_path / "no-model"), "synthetic:color", *args]) == 2
    assert _one_line(capsys) == f"vlrft eval-reward-model: config error: {line}"


def test_eval_reward_model_out_under_a_file_or_at_a_folder_is_refused_before_scoring(tmp_path, capsys):
    """Issue 64, item 5: ``--out`` is written after every record is scored; under a file it was a traceback then."""
    capsys.readouterr()
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    model = str(tmp_path / "no-model")  # checked after the flags: nothing past them ran
    assert main(["eval-reward-model", model, "synthetic:color", "--out", str(notes / "m.json")]) == 2
    assert _one_line(capsys) == (
        f"vlrft eval-reward-model: config error: --out {notes / 'm.json'}: {notes} is a file, so nothing can be "
        "written under it; choose another --out"
    )
    assert main(["eval-reward-model", model, "synthetic:color", "--out", str(tmp_path)]) == 2
    assert _one_line(capsys) == (
        f"vlrft eval-reward-model: config error: --out {tmp_path}: is a folder; --out names the file to write"
    )
    assert main(["eval-reward-model", model, "synthetic:color", "--out", str(tmp_path / "new" / "m.json")]) == 2
    assert _one_line(capsys) == f"vlrft eval-reward-model: config error: model={model}: no such folder"  # --out fine
    assert notes.read_text() == "mine" and not (tmp_path / "new").exists()


# -- item 6: the end-of-run summary reads what it can ----------------------------------------------------
def test_a_damaged_metrics_line_is_skipped_and_counted_after_the_model_is_saved(tmp_path, capsys):
    """Issue 64, item 6: one line of ``metrics.jsonl`` that is not JSON (a kill mid-write, an edit) crashed the
    summary after ``final/`` was written (json.JSONDecodeError); now it is skipped, counted and located."""
    out = tmp_path / "run"
    out.mkdir()
    rows = [{"step": 1, "train/loss": 2.0}, {"step": 1, "eval/accuracy": 0.25}, {"step": 2, "eval/accuracy": 0.5}]
    lines = [json.dumps(rows[0]), '{"step": 2, "train/lo', json.dumps(rows[1]), "", "[1, 2]", json.dumps(rows[2])]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = {
        "command": "train-sft",
        "steps": 2,
        "final_model": str(out / "final"),
        "eval_before": {"accuracy": 0.25},
        "eval_after": {"accuracy": 0.5},
    }
    capsys.readouterr()
    write_summary(out, summary, [{"step": 1, "train/loss": 2.0}, {"step": 2, "train/loss": 1.5}], ("train/loss",))
    captured = capsys.readouterr()
    assert captured.err == (
        f"warning: {out / 'metrics.jsonl'}: skipped 2 line(s) that are not JSON metric rows with a step (line 2, 5)\n"
    )
    assert "held-out accuracy 0.250 -> 0.500" in captured.out
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"


# -- item 7 and 9b: never the root or home; overwrite clears only what a run writes ----------------------
@pytest.mark.parametrize("overwrite", ["false", "true"])
def test_the_filesystem_root_and_the_home_folder_are_never_a_run_folder(tmp_path, capsys, monkeypatch, overwrite):
    """Issue 64, item 7: ``train.output_dir=/`` was offered ``train.overwrite=true`` ("holds another run's outputs
    (bin, boot, ...)"); the root and the home folder itself are now refused outright, overwrite or not. The current
    directory may still hold a run (an empty one made for it) and is never cleared (test_reliability_overwrite.py)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("# mine")
    monkeypatch.setenv("HOME", str(home))
    capsys.readouterr()
    rule = "never an output folder: vlrft writes its outputs (RUN.json, checkpoints, final, metrics.jsonl, ...) into"
    rule += " it beside what is there; give train.output_dir a folder of its own, e.g. runs/NAME"
    assert main(["train-sft", "train.output_dir=/", f"train.overwrite={overwrite}", *QUIET]) == 2
    assert _one_line(capsys) == f"vlrft train-sft: config error: train.output_dir=/: is the filesystem root, {rule}"
    assert main(["train-policy", f"train.output_dir={home}", f"train.overwrite={overwrite}", *QUIET]) == 2
    assert _one_line(capsys) == (
        f"vlrft train-policy: config error: train.output_dir={home}: is your home folder ({home}), {rule}"
    )
    assert _files(home) == {".bashrc": b"# mine"}


def test_a_folder_of_the_users_files_is_not_offered_overwrite(tmp_path, capsys):
    """Issue 64, item 7: a fresh run into a folder vlrft did not write said "use train.overwrite=true to clear it",
    which overwrite then refused; now it says the one thing that works. Refused before any model is built."""
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("\\chapter{One}")
    capsys.readouterr()
    assert main(["train-sft", f"train.output_dir={mine}", "train.resume=never", *QUIET]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"vlrft train-sft: run folder error: {mine}: holds chapter1.tex and this run starts fresh "
        "(train.resume=never); choose another train.output_dir (train.overwrite=true would not clear it: no RUN.json: "
        "not a vlrft run folder)"
    )
    assert _files(mine) == {"chapter1.tex": b"\\chapter{One}"}


# what a finished run folder holds (train-sft with tensorboard and wandb; train-policy adds its logs, a critic run
# its checkpoints), as listed from real runs: overwrite clears all of it
WRITTEN = ["RUN.json", "checkpoints", "config.yaml", "curves.png", "final", "initial-model", "metrics.jsonl"]
WRITTEN += ["summary.json", "tensorboard", "wandb", "samples.jsonl", "data_order.jsonl", "critic_checkpoints"]


def test_overwrite_clears_what_a_run_wrote_and_leaves_the_users_notes(tmp_path):
    """Issue 64, item 9b: ``train.overwrite=true`` removed every name in a folder holding RUN.json, a user's
    notes.txt beside the run included; now it removes what a run writes and counts what it leaves, in one line."""
    run = tmp_path / "run"
    run.mkdir()
    for name in WRITTEN:
        (run / name).mkdir() if "." not in name or name == "final" else (run / name).write_text("{}\n")
        if (run / name).is_dir():
            (run / name / "inside").write_text("x")
    (run / "notes.txt").write_text("lr 1e-3 looked better")
    (run / "plots").mkdir()
    (run / "plots" / "mine.png").write_bytes(b"png")
    said: list[str] = []
    with run_in_folder(run, make_strategy(StrategyConfig()), resume="never", overwrite=True, log=said.append) as rid:
        assert sorted(p.name for p in run.iterdir()) == [LOCK, "RUN.json", "notes.txt", "plots"]
    assert checkpoints.run_id(run) == rid
    cleared = f"{run}: cleared the previous run's outputs (train.overwrite=true)"
    assert said == [f"{cleared}; left 2 not written by a vlrft run: notes.txt, plots"]
    assert (run / "notes.txt").read_text() == "lr 1e-3 looked better" and (run / "plots" / "mine.png").is_file()
    assert set(WRITTEN) <= RUN_OUTPUTS


# -- item 9: a tiny model at a real model's learning rate --------------------------------------------------
GRPO = REPO / "configs" / "policy" / "grpo.yaml"
TINY_LR_LINE = (
    "warning: optim.lr=1e-06 is a learning rate for a real model, but the model built for this run "
    "(model.tiny_arch=qwen2_5_vl, random weights) is tiny (model.tiny_hidden=64): at this rate it will barely move in "
    "train.max_steps=60 steps; tiny models learn at about 1e-3 (vlrft/trainer/demo.yaml uses optim.lr=0.002); "
    "`vlrft train-policy --print-config` shows every value this run uses"
)


def test_a_tiny_model_at_a_real_models_learning_rate_is_one_warning_at_start(tmp_path, capsys):
    """Issue 64, item 9: ``vlrft train-policy configs/policy/grpo.yaml`` (a ready recipe, no model.path) trained a
    random 64-wide model at the schema's 1e-6 and learned nothing, silently. One warning line, not an error: the run
    goes on (here it stops at the next check, its data file, before a model is built)."""
    capsys.readouterr()
    out = tmp_path / "run"
    assert main(["train-policy", str(GRPO), f"train.output_dir={out}", f"data.train_source={tmp_path / 'none.jsonl'}"])
    assert capsys.readouterr().err.splitlines() == [
        TINY_LR_LINE,
        f"vlrft train-policy: config error: data.train_source={tmp_path / 'none.jsonl'}: no such file or folder",
    ]
    assert learning_rate_warning(load_config(PolicyTrainConfig, GRPO, []), "train-policy") == TINY_LR_LINE
    assert not out.exists()


@pytest.mark.parametrize(
    "command, schema",
    [
        ("train-policy", PolicyTrainConfig),
        ("train-sft", SFTTrainConfig),
        ("train-dpo", DPOTrainConfig),
        ("train-reward-model", RewardModelTrainConfig),
    ],
)
def test_the_demos_and_a_wide_enough_model_get_no_learning_rate_warning(command, schema, tiny_model):
    """The embedded demos (tiny models at 2e-3 .. 3e-3; train-reward-model's ready srm_color.yaml at 1e-3) say
    nothing, of their learning rate or anything else they start with; a model folder 256 wide (the rule's bound) at
    1e-6 neither; a 64-wide one at 1e-6 does."""
    assert start_warnings(load_config(schema, DEMOS[command], []), command) == []
    wide = tiny_model("qwen2", hidden=256)
    assert (
        learning_rate_warning(load_config(schema, DEMOS[command], [f"model.path={wide}", "optim.lr=1e-6"]), command)
        is None
    )
    tiny = tiny_model("qwen2")
    line = learning_rate_warning(load_config(schema, DEMOS[command], [f"model.path={tiny}", "optim.lr=1e-6"]), command)
    assert line is not None and line.startswith(
        f"warning: optim.lr=1e-06 is a learning rate for a real model, but model.path={tiny} is a tiny model (hidden "
        "size 64): at this rate it will barely move"
    )
    assert line.endswith(f"`vlrft {command} --print-config` shows every value this run uses")


YES_NO = REPO / "configs" / "policy" / "yes_no.yaml"


def test_synthetic_settings_no_source_draws_are_one_warning_at_start(tmp_path, capsys):
    """A recipe's ``data.synthetic_*`` settings with the sources pointed at a file (``yes_no.yaml`` on one's own
    records) draw nothing: one warning line naming each setting and the source it would apply to, not a silent
    drop; the run goes on (here to its next check, the missing file)."""
    capsys.readouterr()
    out, data = tmp_path / "run", tmp_path / "none.jsonl"
    assert main(["train-policy", str(YES_NO), f"train.output_dir={out}", f"data.train_source={data}"]) == 2
    # the held-out source is still synthetic:yes_no, which draws with the options: no warning
    assert not capsys.readouterr().err.startswith("warning")
    args = [f"data.train_source={data}", f"data.eval_source={data}", "data.synthetic_train_size=16"]
    assert main(["train-policy", str(YES_NO), f"train.output_dir={out}", *args]) == 2
    options = {"num_colors": 2, "noise": 24, "image_size": 112, "paired": True}
    assert capsys.readouterr().err.splitlines() == [
        "warning: not used, as no synthetic:TASK source draws them: "
        f"data.synthetic_train_size=16 (data.train_source={str(data)!r}); "
        f"data.synthetic_options={options} (data.train_source={str(data)!r}, data.eval_source={str(data)!r})",
        f"vlrft train-policy: config error: data.train_source={data}: no such file or folder",
    ]
    assert not out.exists()
    # each size by its own source: the held-out size is unused where the held-out source is a file or empty
    cfg = load_config(PolicyTrainConfig, None, [f"data.eval_source={data}", "data.synthetic_eval_size=8"])
    assert start_warnings(cfg, "train-policy")[-1].endswith(
        f"data.synthetic_eval_size=8 (data.eval_source={str(data)!r})"
    )
    cfg = load_config(PolicyTrainConfig, None, ["data.eval_source=", "data.synthetic_train_size=16", "optim.lr=1e-3"])
    assert start_warnings(cfg, "train-policy") == []
    # the embedded demo's own options (noise 24) are not the user's: `vlrft train-policy data.train_source=mine.jsonl
    # data.eval_source=` says nothing of them (the command compares with the demo it starts from)
    demo = load_config(PolicyTrainConfig, DEMOS["train-policy"], [])
    cfg = load_config(PolicyTrainConfig, DEMOS["train-policy"], [f"data.train_source={data}", "data.eval_source="])
    assert demo.data.synthetic_options and start_warnings(cfg, "train-policy", demo) == []
    # a format-only warm start's recipe (random answers, no held-out source, so no held-out size) says nothing
    fmt = load_config(SFTTrainConfig, [REPO / "configs" / "sft" / "yes_no_format.yaml"], [])
    base = load_config(SFTTrainConfig, None, [])  # what the CLI compares a config file with: the schema's defaults
    assert fmt.data.synthetic_options["random_answers"] is True and start_warnings(fmt, "train-sft", base) == []
    judge = load_config(RewardModelTrainConfig, [REPO / "configs" / "reward_model" / "grm_judge_format.yaml"], [])
    assert judge.data.synthetic_options["random_answers"] is True
    assert start_warnings(judge, "train-reward-model", load_config(RewardModelTrainConfig, None, [])) == []


# -- item 10: record fields vlrft does not read ------------------------------------------------------------
def test_record_fields_vlrft_does_not_read_are_one_counted_warning(tmp_path, caplog):
    """Issue 64, item 10: a media field vlrft does not read (``videos`` before video landed; ``audio`` now) was kept
    in metadata without a word; the reader counts such fields per field in one warning per source and process
    (preflight and the run read the same file)."""
    data = tmp_path / "prompts.jsonl"
    rows = [{"id": f"q{i}", "prompt": "Which colour?", "answer": "red", "audio": [f"clip{i}.wav"]} for i in range(3)]
    rows.append({"id": "q3", "prompt": "Which colour?", "answer": "red", "chosen": "red", "audio": None})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="data_pipelines"):
        records, report = read_records(data, "prompt")
        read_records(data, "prompt")  # the second pass of the same file says nothing more
    line = f"{data}: 4 records have fields vlrft does not read: audio (3), chosen (1); they are kept in the records' "
    assert [r.getMessage() for r in caplog.records] == [line + "metadata only"]
    assert report.unread == {"audio": 3, "chosen": 1} and report.unread_records == 4
    assert records[0].metadata == {"audio": ["clip0.wav"]} and records[3].metadata == {"chosen": "red"}


# -- item 8: Ctrl-C ------------------------------------------------------------------------------------------
def test_ctrl_c_is_one_line_saying_what_it_cost(tmp_path, tiny_model):
    """Issue 64, item 8: Ctrl-C was a KeyboardInterrupt traceback from wherever it landed. The real command in a
    process of its own, stopped by SIGINT once it evaluates (its run.json written, 400 prompts to go): one line, exit
    code 130, the samples written so far kept. (A training run loses the steps after its last checkpoint; that the
    loop should checkpoint on a first Ctrl-C as it does on SIGTERM is for vlrft/loop.py.)"""
    data = tmp_path / "records.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"{i}+1?", "answer": "x"}) + "\n" for i in range(400)))
    out = tmp_path / "e"
    evaluation = ["eval", "--benchmark", "mine", "--verifier", "exact_match", "--model", str(tiny_model("qwen2"))]
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlrft", *evaluation, "--data", str(data), "--out", str(out), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's foreground job has it
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "run.json").is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate(timeout=60)[1]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.splitlines() == [
        "vlrft eval: interrupted (Ctrl-C); the samples written so far are kept, and the same command continues "
        "from them"
    ]
    assert not (out / "metrics.json").exists()


def test_a_first_ctrl_c_stops_a_training_run_with_a_checkpoint_even_with_save_every_0(tmp_path, tiny_model):
    """Issue 64, item 9: Ctrl-C lost every step with ``save_every: 0`` where SIGTERM saved. A first Ctrl-C now does
    what SIGTERM does: the run stops after its current step with a complete checkpoint (exit code 75, the requeue
    code), and the same command continues it."""
    out = tmp_path / "sft"
    cmd = [sys.executable, "-m", "vlrft", "train-sft", f"model.path={tiny_model('qwen2_5_vl')}", "train.max_steps=500"]
    cmd += ["train.save_every=0", "train.batch_size=2", "data.synthetic_train_size=16", f"train.output_dir={out}"]
    cmd += ["data.eval_source=''", *QUIET]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's foreground job has it
    )
    try:
        deadline = time.monotonic() + 300
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2) and proc.poll() is None:
            assert time.monotonic() < deadline, "the run did not reach its second step"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        got, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-3000:]
    assert "Ctrl-C: stopping after this step with a checkpoint; Ctrl-C again to stop now" in got
    assert "stopped by Ctrl-C (SIGINT) after step" in err and "Traceback" not in err, err[-3000:]
    done = checkpoints.complete_checkpoints(out / "checkpoints")
    assert len(done) == 1 and int(done[0].name.removeprefix("step-")) >= 2
    assert json.loads((out / "PREEMPTED").read_text())["signal"] == "Ctrl-C (SIGINT)"
