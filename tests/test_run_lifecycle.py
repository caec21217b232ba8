"""The one run driver (vlrft/loop.py) for all five trainers: the same outputs (final/, summary.json), the same
metric names for the same quantities, and a SIGKILLed run that resumes to the bitwise-same model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch import QUIET, SECOND_ARITHMETIC, kill_when, run_job, subprocess_env, torchrun
from records import say_the_colour
from safetensors.torch import load_file

from vlrft.archs import ARCHS, TEXT_ARCHS
from vlrft.cli import main

REPO = Path(__file__).resolve().parents[1]
SMALL = ["data.synthetic_train_size=16", "data.synthetic_eval_size=4"]

# trainer -> (command, its overrides for a small run)
TRAINERS = {
    "policy": (
        "train-policy",
        ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=4", "optim.lr=1e-3"],
    ),
    "sft": ("train-sft", ["train.batch_size=4"]),
    "dpo": ("train-dpo", ["train.batch_size=4"]),
    "srm": ("train-reward-model", ["model.kind=srm", "train.batch_size=4", "optim.lr=1e-3"]),
    "judge": (
        "train-reward-model",
        ["model.kind=grm", "train.batch_size=4", "judge.max_new_tokens=6", "optim.lr=1e-3"],
    ),
}

# what every trainer logs under the same name (the driver's and the strategies' quantities)
SHARED_METRICS = {
    "train/loss",
    "train/grad_norm",
    "train/lr",
    "train/nonfinite_skipped",
    "train/steps_per_s",
    "time/step",
}
SUMMARY_KEYS = {"command", "steps", "output_dir", "final_model", "eval_before", "eval_after", "last_metrics"}


def _args(name: str, model: Path, out: Path, *extra: str) -> list[str]:
    command, overrides = TRAINERS[name]
    return [command, f"model.path={model}", f"train.output_dir={out}", *SMALL, *overrides, *QUIET, *extra]


def _start(name: str, model: Path, out: Path, *extra: str, **popen) -> subprocess.Popen:
    """The trainer's command in its own interpreter (to be killed or signalled)."""
    popen.setdefault("env", subprocess_env())
    return subprocess.Popen([sys.executable, "-m", "vlrft", *_args(name, model, out, *extra)], **popen)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", list(TRAINERS))
def test_every_trainer_writes_final_summary_and_the_shared_metric_names(name, tiny_model, tmp_path):
    out = tmp_path / name
    assert main(_args(name, tiny_model("qwen2_5_vl"), out, "train.max_steps=2", "train.log_every=1")) == 0
    rows = _rows(out)
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert SHARED_METRICS <= set(r), (name, SHARED_METRICS - set(r))
        # the names the loops used to differ on are gone
        assert not {"grad_norm", "lr", "loss", "nonfinite_skipped"} & set(r), name
        assert not any(k.startswith("timing/") for k in r), name
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in evals] == [0, 2] and all(set(r) - {"step"} == set(evals[0]) - {"step"} for r in evals)
    assert (out / "final" / "model.safetensors").is_file() and (out / "config.yaml").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary) and summary["steps"] == 2 and summary["command"] == TRAINERS[name][0]
    # the summary's held-out figures are the logged ones, without the eval/ prefix
    assert summary["eval_after"] == {k.removeprefix("eval/"): v for k, v in evals[-1].items() if k != "step"}
    assert summary["final_model"] == str(out / "final")
    # best/: the model of the first evaluation with the highest held-out accuracy (step 0 counts), beside final/
    metric = {"srm": "pairwise_accuracy", "judge": "judgment_accuracy"}.get(name, "accuracy")
    acc = {r["step"]: r[f"eval/{metric}"] for r in evals}
    step = min(k for k, v in acc.items() if v == max(acc.values()))
    want = {"step": step, "metric": metric, "value": acc[step]}
    assert summary["best"] == {**want, "path": str(out / "best")}, (summary["best"], acc)
    assert json.loads((out / "best" / "best.json").read_text()) == want
    assert (out / "best" / "model.safetensors").is_file() and (out / "best" / "MANIFEST.json").is_file()
    assert not [p for p in out.iterdir() if p.name.endswith((".tmp", ".old"))]


def _resumes_bitwise(
    name: str, model: Path, tmp_path: Path, env: dict[str, str] | None = None, extra: tuple[str, ...] = ()
) -> None:
    """An uninterrupted run and one SIGKILLed after its step-4 checkpoint then resumed end with the same weights
    and training metrics; with ``env``, every run in its own interpreter under that environment; ``extra``: more
    overrides."""
    common = ["train.max_steps=8", "train.save_every=2", "train.keep_last=2", "train.log_every=1", "train.eval_every=1"]
    common += list(extra)
    ref, run = tmp_path / "ref", tmp_path / "killed"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}

    def finish(out: Path) -> None:
        if env is None:
            assert main(_args(name, model, out, *common)) == 0
        else:
            proc = _start(name, model, out, *common, env=subprocess_env(**env), **quiet)
            assert proc.wait() == 0, proc.stderr.read().decode()[-3000:]

    finish(ref)
    proc = _start(
        name,
        model,
        run,
        *common,
        env=subprocess_env(**(env or {})),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    ckpt = run / "checkpoints" / "step-000004" / "COMPLETE"
    kill_when(proc, ckpt)
    assert ckpt.exists() and not (run / "final").exists(), "the run must be killed between step 4 and its end"
    finish(run)
    want, got = load_file(str(ref / "final" / "model.safetensors")), load_file(str(run / "final" / "model.safetensors"))
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert set(want) == set(got) and not differ, f"{len(differ)} of {len(want)} tensors differ"  # bitwise
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000006", "step-000008"]
    # the resumed run's log holds each step once, with the uninterrupted run's training figures
    drop = {k for r in _rows(ref) for k in r if k.startswith("time/") or "per_s" in k}  # timings
    strip = lambda rows: [{k: v for k, v in r.items() if k not in drop} for r in rows]  # noqa: E731
    assert strip(_rows(run)) == strip(_rows(ref))
    assert json.loads((run / "summary.json").read_text())["resumed_from"].endswith("step-000004")


@pytest.mark.parametrize("name", list(TRAINERS))
def test_sigkilled_run_resumes_bitwise(name, tiny_model, tmp_path):
    """Killed (SIGKILL) after its step-4 checkpoint, every trainer's run resumes to the same final weights and the
    same training metrics as an uninterrupted run (one evaluation per step slows the run so the kill lands)."""
    _resumes_bitwise(name, tiny_model("qwen2_5_vl"), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["policy", "dpo"])
def test_sigkilled_run_resumes_bitwise_under_a_second_arithmetic(name, tiny_model, tmp_path):
    """The same under ``SECOND_ARITHMETIC`` (tests/launch.py), whose float32 products round by the batch's row count
    as an Intel Xeon's kernels did, for the policy and DPO (whose resume failed on the Xeon: 46 of 57 tensors
    differed; its reference log-probs are now part of the checkpoint, tests/test_sft_dpo.py). The other trainers
    share the driver and its checkpoint; kept to two for the slow suite's time."""
    _resumes_bitwise(name, tiny_model("qwen2_5_vl"), tmp_path, SECOND_ARITHMETIC)


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, extra",
    [("qwen3_5", ()), ("qwen3_5_moe", ()), ("qwen3_vl_moe", ("rollout.routing_replay=true",)), ("qwen3", ())],
    ids=["qwen3_5", "qwen3_5_moe", "qwen3_vl_moe-routing_replay", "qwen3-text"],
)
def test_sigkilled_policy_run_on_the_new_archs_resumes_bitwise(arch, extra, tiny_model, tmp_path):
    """Issue 60: a train-policy run of Qwen3.5 (hybrid linear attention), Qwen3.5-MoE (router loss on) and
    Qwen3-VL-MoE with rollout routing replay, SIGKILLed after its step-4 checkpoint, resumes to the uninterrupted
    run's weights and training metrics, bitwise; text Qwen3 the same on a file of text records."""
    if arch not in ARCHS:
        pytest.skip(f"transformers without {arch} (5.24 has it)")
    if arch in TEXT_ARCHS:
        records = say_the_colour(tmp_path)
        source = "reward.sources=[{name: accuracy, kind: verifier, verifier: exact_match}]"
        extra = (*extra, f"data.train_source={records}", f"data.eval_source={records}", source)
    _resumes_bitwise("policy", tiny_model(arch), tmp_path, extra=extra)


@pytest.mark.parametrize("command", ["train-sft", "train-dpo"])
def test_supervised_runs_fail_in_preflight_before_anything_loads(command, tmp_path, capsys):
    """The driver runs each trainer's preflight first: a missing model folder or data file is one line, exit 2,
    and no run folder is made."""
    out = tmp_path / "run"
    assert main([command, f"model.path={tmp_path / 'nope'}", f"train.output_dir={out}", *QUIET]) == 2
    assert f"model.path={tmp_path / 'nope'}: no such folder" in capsys.readouterr().err
    missing = tmp_path / "missing.jsonl"
    assert main([command, f"data.train_source={missing}", f"train.output_dir={out}", *QUIET]) == 2
    assert f"data.train_source={missing}: no such file or folder" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "command, old, new",
    [
        ("train-policy", "train.accuracy_source=accuracy", "reward.accuracy_source"),
        ("train-reward-model", "data.synthetic_task=color", "data.train_source=synthetic:TASK"),
        ("train-reward-model", "data.synthetic_seed=3", "train.seed"),
    ],
)
def test_replaced_keys_are_refused_naming_their_replacement(command, old, new, tmp_path, capsys):
    """Keys users may still have in their files: one line naming the key that replaced them (override and YAML)."""
    assert main([command, old, f"train.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"config key '{old.split('=')[0]}' is gone; use {new}" in err and "Traceback" not in err
    key, value = old.split("=")
    section, leaf = key.split(".")
    (tmp_path / "old.yaml").write_text(f"{section}:\n  {leaf}: {value}\n")
    assert main([command, str(tmp_path / "old.yaml"), f"train.output_dir={tmp_path / 'run'}"]) == 2
    assert f"config key '{key}' is gone; use {new}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_synthetic_sources_have_one_spelling(tiny_model, tmp_path, capsys):
    """synthetic:TASK everywhere; the old synthetic:TASK:N:SEED form is one data error naming the right one."""
    rc = main(["eval-reward-model", str(tiny_model("qwen2_5_vl")), "synthetic:color:64:1"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown synthetic task 'color:64:1'; write synthetic:TASK" in err, err


def _wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Until the run's metrics.jsonl has training step ``step`` (or the process ended)."""
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        try:
            if any(r.get("step", 0) >= step and "train/loss" in r for r in _rows(out)):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.02)


@pytest.mark.parametrize("name", list(TRAINERS))
def test_sigterm_saves_a_checkpoint_and_the_same_command_continues_bitwise(name, tiny_model, tmp_path):
    """SIGTERM mid-run (train.save_every=0): the step ends, a complete checkpoint is written, the lock released,
    one line says where it stopped, exit code 75; the same command then ends with the uninterrupted weights."""
    model = tiny_model("qwen2_5_vl")
    common = ["train.max_steps=8", "train.log_every=1", "train.eval_every=1"]  # no periodic checkpoints
    ref, run = tmp_path / "ref", tmp_path / "stopped"
    assert main(_args(name, model, ref, *common)) == 0
    proc = _start(name, model, run, *common, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(run, 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 75, err[-3000:]
    said = [line for line in err.splitlines() if "preempted:" in line]
    assert len(said) == 1 and "stopped by SIGTERM after step" in said[0] and "run the same command again" in said[0]
    stopped = int(said[0].split("after step ")[1].split("/")[0])
    assert 2 <= stopped < 8 and (run / "checkpoints" / f"step-{stopped:06d}" / "COMPLETE").is_file()
    assert not (run / "LOCK").exists() and not (run / "final").exists()
    assert json.loads((run / "PREEMPTED").read_text())["step"] == stopped  # what a job script requeues on
    assert main(_args(name, model, run, *common)) == 0
    assert not (run / "PREEMPTED").exists()
    want, got = load_file(str(ref / "final" / "model.safetensors")), load_file(str(run / "final" / "model.safetensors"))
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)  # bitwise


@pytest.mark.distributed
def test_sigterm_to_a_two_rank_fsdp2_run_checkpoints_and_continues_bitwise(tiny_model, tmp_path):
    """SIGTERM to torchrun and its 2 FSDP2 ranks (what a scheduler sends a job step): both ranks stop after the
    same step, one complete checkpoint, the lock released; the same command continues to the uninterrupted weights."""
    model = tiny_model("qwen2_5_vl")
    common = ["train.max_steps=8", "train.log_every=1", "train.eval_every=1", "strategy.name=fsdp2"]

    def cmd(out: Path, offset: int) -> list[str]:
        return torchrun("-m", "vlrft", *_args("policy", model, out, *common), port_offset=offset)

    ref, run = tmp_path / "ref", tmp_path / "stopped"
    res = run_job(cmd(ref, 0), env=subprocess_env(), timeout=840)
    assert res.returncode == 0, res.stderr[-3000:]
    out = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(cmd(run, 1), env=subprocess_env(), start_new_session=True, **out)
    _wait_for_step(run, 2, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    # one line per rank; two ranks writing to one pipe may run their lines together, so match, not split
    said = re.findall(r"preempted: stopped by (SIG\w+) after step (\d+)/", err)
    assert len(said) == 2 and {sig for sig, _ in said} == {"SIGTERM"}, err[-3000:]
    stopped = {int(step) for _, step in said}
    assert len(stopped) == 1  # every rank after the same step
    step = stopped.pop()
    assert (run / "checkpoints" / f"step-{step:06d}" / "COMPLETE").is_file() and not (run / "LOCK").exists()
    assert json.loads((run / "PREEMPTED").read_text())["signal"] == "SIGTERM"
    res = run_job(cmd(run, 2), env=subprocess_env(), timeout=840)
    assert res.returncode == 0, res.stderr[-3000:]
    want, got = load_file(str(ref / "final" / "model.safetensors")), load_file(str(run / "final" / "model.safetensors"))
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)  # bitwise


def test_the_export_is_renamed_into_place_with_a_manifest_and_its_summary(tiny_model, tmp_path):
    """final/ is written beside (final.tmp) and renamed into place: it carries MANIFEST.json (every file, size,
    sha256) and the run's summary.json; what a cut-off export left behind is cleared, never taken for final/."""
    from vlrft.checkpoints import verify_checkpoint

    out = tmp_path / "sft"
    args = _args("sft", tiny_model("qwen2_5_vl"), out, "train.max_steps=2")
    assert main(args) == 0
    final = out / "final"
    manifest = json.loads((final / "MANIFEST.json").read_text())
    assert {"model.safetensors", "config.json", "summary.json"} <= set(manifest["files"])
    (final / "COMPLETE").write_text("ok\n")  # verify_checkpoint's marker: the manifest itself must match
    assert verify_checkpoint(final) is None
    assert json.loads((final / "summary.json").read_text()) == json.loads((out / "summary.json").read_text())
    # an export cut off in a later run: a half-written final.tmp and a final.old
    (out / "final.tmp").mkdir()
    (out / "final.tmp" / "model.safetensors").write_bytes(b"half")
    (out / "final.old").write_text("x")
    assert main([*args, "train.max_steps=3"]) == 0  # resumes from step 2, exports again
    assert not (out / "final.tmp").exists() and not (out / "final.old").exists()
    assert json.loads((final / "summary.json").read_text())["steps"] == 3
    assert (final / "model.safetensors").stat().st_size > 1000


@pytest.mark.distributed
def test_the_slurm_script_hands_the_time_limit_signal_to_the_ranks(tiny_model, tmp_path):
    """scripts/slurm_preemptible.sbatch run as Slurm runs it, then SIGUSR1 to the batch shell alone (what
    `--signal=B:USR1@300` does before the time limit): the script hands it to both ranks, which stop after the
    same step with a checkpoint and leave OUTPUT_DIR/PREEMPTED, the file the script requeues on."""
    out = tmp_path / "run"
    args = _args("policy", tiny_model("qwen2_5_vl"), out, "train.max_steps=8", "train.eval_every=1")[1:]
    args = [a for a in args if not a.startswith("train.output_dir=")] + ["strategy.name=fsdp2", "train.log_every=1"]
    env = subprocess_env(OUT=str(out), NPROC="2")
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(["bash", "scripts/slurm_preemptible.sbatch", *args], cwd=REPO, env=env, **pipes)
    _wait_for_step(out, 2, proc)
    os.kill(proc.pid, signal.SIGUSR1)
    _, err = proc.communicate(timeout=600)
    said = re.findall(r"preempted: stopped by (SIG\w+) after step (\d+)/", err)  # one per rank (see above)
    assert len(said) == 2 and {sig for sig, _ in said} == {"SIGUSR1"} and len({s for _, s in said}) == 1, err[-3000:]
    note = json.loads((out / "PREEMPTED").read_text())
    assert note["signal"] == "SIGUSR1" and (Path(note["checkpoint"]) / "COMPLETE").is_file()
    assert not (out / "LOCK").exists() and not (out / "final").exists()


def test_resume_refuses_a_changed_config_unless_allowed_and_then_uses_the_new_values(tiny_model, tmp_path, capsys):
    """A resumed run compares its config with the run's: cadence and step count may change (said in one line);
    anything else (the learning rate, the data, the model) is refused with the list of differences before anything
    loads, unless train.resume_changes=allow, with which the new learning rate is really used from that step."""
    model = tiny_model("qwen2_5_vl")
    out = tmp_path / "sft"
    base = _args("sft", model, out, "train.max_steps=2", "train.log_every=1")
    assert main(base) == 0
    capsys.readouterr()
    assert main([*base, "train.max_steps=3", "train.eval_every=1"]) == 0  # allowed: continues to step 3
    assert [r["step"] for r in _rows(out) if "train/loss" in r] == [1, 2, 3]
    for change, shown in [
        ("optim.lr=0.5", "optim.lr: 0.003 -> 0.5"),
        ("data.synthetic_options={num_colors: 2}", "data.synthetic_options.num_colors: 4 -> 2"),
        ("model.tiny_hidden=128", "model.tiny_hidden: 64 -> 128"),
    ]:
        capsys.readouterr()
        assert main([*base, "train.max_steps=4", change]) == 2
        err = capsys.readouterr().err
        assert "config error: train.resume: the run in" in err and shown in err and "resume_changes=allow" in err, err
    assert [r["step"] for r in _rows(out) if "train/loss" in r] == [1, 2, 3]  # nothing ran
    assert main([*base, "train.max_steps=4", "optim.lr=0.5", "train.resume_changes=allow"]) == 0
    assert "resume: config changed (optim.lr: 0.003 -> 0.5)" in capsys.readouterr().out
    # the new value, really used
    assert [r["train/lr"] for r in _rows(out) if r["step"] == 4 and "train/lr" in r] == [0.5]
