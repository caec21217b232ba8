"""Model folders, data files and output folders are checked before any model is built (issue 11: "Bad data
surfaces late", "Late and misleading errors"; eval misuse)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from data_pipelines.errors import DataError
from reward_models.config import RewardModelTrainConfig
from vlrft.cli import main as vlrft_main
from vlrft.config import ConfigError, load_config
from vlrft.models.loading import resolve_model_path
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.preflight import preflight_policy, preflight_reward_model
from vlrft.trainer.run import load_prompt_records


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _policy(tmp_path: Path, *overrides: str) -> PolicyTrainConfig:
    base = [f"train.output_dir={tmp_path / 'run'}", "data.eval_source=", "rollout.rollout_batch_size=2"]
    return load_config(PolicyTrainConfig, None, base + list(overrides))


def _colours(tmp_path: Path, *extra: dict) -> Path:
    rows = [{"id": f"c{i}", "prompt": "Which colour?", "answer": "red"} for i in range(3)]
    return _jsonl(tmp_path / "colours.jsonl", rows + list(extra))


# -- model folders ------------------------------------------------------------------------------------
def test_a_missing_local_model_path_says_no_such_folder_not_repo_id(tmp_path):
    for value in ("./no-model", str(tmp_path / "no-model"), "runs/x/final/"):
        with pytest.raises(ConfigError) as err:
            preflight_policy(_policy(tmp_path, f"model.path={value}"), world=1)
        assert str(err.value) == f"model.path={value}: no such folder"
    assert not (tmp_path / "run").exists()


def test_a_hub_id_that_is_not_cached_offline_says_so(tmp_path):
    with pytest.raises(ConfigError, match=r"model.path=someone/not-here: no such folder, and as a hub id it is not"):
        preflight_policy(_policy(tmp_path, "model.path=someone/not-here"), world=1)


def test_a_model_folder_without_tokenizer_files_is_refused_before_generate(tiny_model, tmp_path, capsys):
    folder = shutil.copytree(tiny_model("qwen2"), tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(ConfigError, match=rf"model.path={folder}: no tokenizer files \(tokenizer.json"):
        preflight_policy(_policy(tmp_path, f"model.path={folder}"), world=1)
    rc = vlrft_main(
        ["eval", "--benchmark", "gsm8k", "--model", str(folder), "--data", "d", "--out", str(tmp_path / "e")]
    )
    assert rc == 2 and not (tmp_path / "e").exists()  # vlrft eval checks the folder the same way
    last = capsys.readouterr().err.splitlines()[-1]  # (after the tiny model's build output, when built here)
    assert last.startswith(f"vlrft eval: config error: --model={folder}: no tokenizer files")


def test_a_vision_model_folder_without_processor_files_is_refused(tiny_model, tmp_path):
    folder = shutil.copytree(tiny_model("qwen2_5_vl"), tmp_path / "m")
    (folder / "processor_config.json").unlink()
    with pytest.raises(ConfigError, match="a vision-language model without processor files"):
        preflight_policy(_policy(tmp_path, f"model.path={folder}"), world=1)


def test_a_folder_without_config_json_points_at_the_run_folders_final_model(tiny_model, tmp_path):
    run = tmp_path / "old-run"
    shutil.copytree(tiny_model("qwen2"), run / "final")
    with pytest.raises(ConfigError, match=rf"no config.json in this folder; use {run / 'final'}"):
        preflight_policy(_policy(tmp_path, f"model.path={run}"), world=1)


# -- data --------------------------------------------------------------------------------------------
def test_a_missing_data_file_is_found_before_the_model_is_built(tmp_path):
    with pytest.raises(ConfigError, match=r"data.train_source=missing.jsonl: no such file or folder"):
        preflight_policy(_policy(tmp_path, "data.train_source=missing.jsonl"), world=1)
    assert not (tmp_path / "run").exists()


def test_a_record_without_answer_is_a_located_error_before_training(tmp_path):
    data = _colours(tmp_path, {"id": "no-answer", "prompt": "Which colour?"})
    with pytest.raises(DataError) as err:
        preflight_policy(_policy(tmp_path, f"data.train_source={data}"), world=1)
    assert str(err.value) == (
        f"{data}:4 field 'answer': record 'no-answer' has no answer, which reward source 'accuracy' "
        "(verifier vocab_answer) needs"
    )


def test_skip_mode_counts_the_record_without_answer_and_the_run_reads_without_it(tmp_path, tiny_model):
    data = _colours(
        tmp_path, {"id": "no-answer", "prompt": "Which colour?"}, {"id": "blank", "prompt": "?", "answer": " "}
    )
    cfg = _policy(tmp_path, f"data.train_source={data}", "data.on_bad_record=skip", f"model.path={tiny_model('qwen2')}")
    report = preflight_policy(cfg, world=1)["data.train_source"]
    assert (report.read, report.kept, report.skipped) == (5, 3, 2) and report.counts["missing answer"] == 2
    from vlrft.models.loading import load_processor

    records = load_prompt_records(str(data), cfg, 0, 0, load_processor(tiny_model("qwen2")))
    assert [r.id for r in records] == ["c0", "c1", "c2"]  # the run skips exactly what preflight counted


def test_too_few_prompts_left_after_skipping_is_refused_at_once(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "?", "answer": "red"}, {"id": "b", "prompt": "?"}])
    cfg = _policy(tmp_path, f"data.train_source={data}", "data.on_bad_record=skip")
    with pytest.raises(ConfigError, match=r"1 usable prompts \(1 skipped\), fewer than rollout.rollout_batch_size=2"):
        preflight_policy(cfg, world=1)


def test_answers_are_needed_only_by_the_sources_that_score_the_task(tmp_path):
    rows = [{"id": f"f{i}", "prompt": "Think.", "task": "free"} for i in range(2)]
    data = _jsonl(tmp_path / "d.jsonl", rows + [{"id": "m", "prompt": "2+2?", "answer": "4", "task": "maths"}])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "reward:\n  sources:\n    - {name: acc, verifier: exact_match}\n    - {name: fmt, verifier: format}\n"
        "  recipes:\n    free: {fmt: 1.0}\n    maths: {acc: 1.0, fmt: 0.1}\n"
    )
    overrides = [f"train.output_dir={tmp_path / 'run'}", "data.eval_source=", "rollout.rollout_batch_size=2"]
    good = load_config(PolicyTrainConfig, cfg, overrides + [f"data.train_source={data}"])
    assert preflight_policy(good, world=1)["data.train_source"].kept == 3
    _jsonl(data, rows + [{"id": "m", "prompt": "2+2?", "task": "maths"}])
    with pytest.raises(
        DataError, match=r"d.jsonl:3 field 'answer': record 'm' has no answer, which reward source 'acc'"
    ):
        preflight_policy(good, world=1)


def test_an_unknown_verifier_is_refused_before_loading(tmp_path):
    cfg = _policy(tmp_path, "reward.sources=[{name: acc, verifier: gsm8kk}]")
    with pytest.raises(ConfigError, match=r"reward.sources\[0\].verifier=gsm8kk: unknown verifier; known: gsm8k"):
        preflight_policy(cfg, world=1)


def test_synthetic_options_the_task_would_refuse_are_named_before_loading(tmp_path, capsys):
    """A misspelt option, a value the task's checks refuse, or an option of another record maker: one line naming
    data.synthetic_options, the source and the rule, before any model is built (not a TypeError from the drawing)."""
    cfg = _policy(tmp_path, "data.synthetic_options={nois: 3}")
    with pytest.raises(
        ConfigError,
        match=r"data.synthetic_options=\{'nois': 3\} \(data.train_source=synthetic:color\): "
        r"synthetic:color takes no option 'nois'; its options: num_colors, colors, image_size, mode",
    ):
        preflight_policy(cfg, world=1)
    cfg = _policy(tmp_path, "data.train_source=synthetic:mark_color", "data.synthetic_options={mark_size: 47}")
    with pytest.raises(ConfigError, match=r"synthetic:mark_color: mark_size must be even and fit in a quadrant"):
        preflight_policy(cfg, world=1)
    assert preflight_policy(_policy(tmp_path, "data.synthetic_options={noise: 24, num_colors: 3}"), world=1) == {}
    # the record maker's own option, taken by every task, with its type checked
    assert preflight_policy(_policy(tmp_path, "data.synthetic_options={random_answers: true}"), world=1) == {}
    with pytest.raises(ConfigError, match=r"synthetic:color: random_answers must be true or false, got 'maybe'"):
        preflight_policy(_policy(tmp_path, "data.synthetic_options={random_answers: maybe}"), world=1)
    # a judge's prompts take the judgment maker's template too; a policy's plain prompts do not
    judge_template = "data.synthetic_options={judge_template: '{question}'}"
    judge = _policy(
        tmp_path, "data.record_kind=judgment", "reward.sources=[{name: v, verifier: judge_verdict}]", judge_template
    )
    assert preflight_policy(judge, world=1) == {}
    with pytest.raises(ConfigError, match=r"takes no option 'judge_template'"):
        preflight_policy(_policy(tmp_path, judge_template), world=1)
    # the CLI: one line, exit 2, nothing built
    code = vlrft_main(["train-sft", f"train.output_dir={tmp_path / 'sft'}", "data.synthetic_options={colr: 1}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "takes no option 'colr'" in err, err
    assert not (tmp_path / "sft").exists()


def test_image_records_for_a_text_only_model_are_named_as_such(tmp_path, tiny_model):
    data = _colours(tmp_path, {"id": "pic", "prompt": "<image>Which colour?", "images": ["x.png"], "answer": "red"})
    for overrides in ([f"model.path={tiny_model('qwen2')}"], ["model.tiny_arch=qwen2"]):
        with pytest.raises(
            DataError, match=r"colours.jsonl:4 field 'images': record 'pic' has 1 image\(s\), but the model"
        ):
            preflight_policy(_policy(tmp_path, f"data.train_source={data}", *overrides), world=1)


# -- output folder -----------------------------------------------------------------------------------
def test_a_file_named_final_in_the_output_folder_is_refused_before_training(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "final").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"train.output_dir=.*run/final is a file, but the final model is written"):
        preflight_policy(_policy(tmp_path), world=1)


def test_an_output_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "run").write_text("x")
    with pytest.raises(ConfigError, match=r"train.output_dir=.*run: is a file, not a folder"):
        preflight_policy(_policy(tmp_path), world=1)


# -- the reward-model trainer gets the same checks ---------------------------------------------------
def _rm(tmp_path: Path, *overrides: str) -> RewardModelTrainConfig:
    return load_config(RewardModelTrainConfig, None, [f"train.output_dir={tmp_path / 'rm'}", *overrides])


def test_reward_model_trainer_checks_model_data_and_output_before_loading(tmp_path):
    with pytest.raises(ConfigError, match=r"^model.path=./none: no such folder$"):
        preflight_reward_model(_rm(tmp_path, "model.path=./none"))
    with pytest.raises(ConfigError, match=r"^data.train_source=pairs.jsonl: no such file or folder$"):
        preflight_reward_model(_rm(tmp_path, "data.train_source=pairs.jsonl"))
    pairs = _jsonl(
        tmp_path / "pairs.jsonl", [{"id": "p", "prompt": "?", "chosen": "a", "rejected": "b"}, {"prompt": "?"}]
    )
    with pytest.raises(DataError, match=r"pairs.jsonl:2 field 'chosen': missing field"):
        preflight_reward_model(_rm(tmp_path, f"data.train_source={pairs}"))
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "final").write_text("x")
    with pytest.raises(ConfigError, match=r"rm/final is a file, but the final model is written"):
        preflight_reward_model(_rm(tmp_path))


def test_train_reward_model_cli_refuses_a_missing_model_with_one_line(tmp_path, capsys):
    assert vlrft_main(["train-reward-model", "model.path=./none", f"train.output_dir={tmp_path / 'rm'}"]) == 2
    assert capsys.readouterr().err == "vlrft train-reward-model: config error: model.path=./none: no such folder\n"
    assert not (tmp_path / "rm").exists()


# -- eval ---------------------------------------------------------------------------------------------
def test_eval_model_takes_a_run_folder_and_refuses_a_step_checkpoint(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_model("qwen2"), run / "final")
    capsys.readouterr()  # the tiny model's build output, if it was built here
    step = run / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("ok\n")
    assert resolve_model_path(run) == str(run / "final")
    rc = vlrft_main(["eval", "--benchmark", "gsm8k", "--model", str(step), "--data", "x", "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"vlrft eval: config error: --model {step}: a training checkpoint")
    assert f"use the run folder {run} (its final/ model" in err and "Traceback" not in err


def test_eval_refuses_records_of_another_task_with_the_counts(tiny_model, shared_data, tmp_path, capsys):
    gsm8k = shared_data / "gsm8k" / "test.jsonl"
    n = sum(1 for line in gsm8k.read_text().splitlines() if line.strip())
    args = ["eval", "--benchmark", "geo3k", "--model", str(tiny_model("qwen2")), "--data", str(gsm8k)]
    capsys.readouterr()  # the tiny model's build output, if it was built here
    assert vlrft_main([*args, "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vlrft eval: data error: {gsm8k}: {n} of {n} records are not 'geo3k' records")
    assert f"({n} with task 'default')" in err and not (tmp_path / "e").exists()


@pytest.mark.parametrize(
    "flag, value, rule",
    [
        ("--temperature", "-1", ">= 0 (0: greedy)"),
        ("--max-new-tokens", "0", ">= 1"),
        ("--top-p", "0", "> 0 and <= 1"),
        ("--top-p", "2", "> 0 and <= 1"),
        ("--n", "0", ">= 1"),
        ("--batch-size", "0", ">= 1"),
    ],
)
def test_eval_refuses_sampling_values_that_make_no_sense(tmp_path, capsys, flag, value, rule):
    args = ["eval", "--benchmark", "gsm8k", "--model", "m", "--data", "d", "--out", str(tmp_path / "e"), flag, value]
    assert vlrft_main(args) == 2
    shown = str(float(value)) if flag in ("--temperature", "--top-p") else value
    assert capsys.readouterr().err == f"vlrft eval: config error: {flag} {shown}: must be {rule}\n"
