"""One line for each failure (issue 23, item 7), driven through the ``vlrft`` command line as a user meets them:
a lone surrogate in a record, duplicate eval ids, an ``--out`` holding other results, a prompt past the model's
positions, a run folder given to ``eval-reward-model``. Each is one line on stderr and exit code 2, before
any model is loaded or anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from data_pipelines.readers import read_records
from vlrft.cli import main
from vlrft.models.loading import load_processor

GOOD = {"id": "q1", "prompt": "What is 1+1?", "answer": "2"}
SURROGATE_LINE = b'{"id": "q2", "prompt": "What is 2+2? \\ud800 x", "answer": "4"}\n'
SURROGATE_MESSAGE = (
    "field 'prompt': a lone surrogate (\\ud800) at character 14; text must be valid Unicode (in JSON, a "
    "\\ud800-\\udfff escape is valid only as half of a high-low pair)"
)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _eval(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """``vlrft eval`` of prompt records as a user benchmark (exact match), two new tokens per prompt."""
    paths = ["--model", str(model), "--data", str(data), "--out", str(out)]
    return ["eval", "--benchmark", "mine", "--verifier", "exact_match", *paths, "--max-new-tokens", "2", *extra]


def _last_line(capsys) -> str:
    return capsys.readouterr().err.splitlines()[-1]  # (after the tiny model's build output, when built here)


def test_a_lone_surrogate_is_one_located_line_in_eval_train_policy_and_train_sft(tiny_model, tmp_path, capsys):
    """Issue 23, item 7.1: a JSON ``\\ud800`` escape with no pair in a prompt was a tokenizer traceback
    (``TextEncodeInput must be Union[...]``) in eval, train-policy and train-sft; the reader now refuses it."""
    model = tiny_model("qwen2")
    data = tmp_path / "d.jsonl"
    data.write_bytes(json.dumps(GOOD).encode() + b"\n" + SURROGATE_LINE)
    assert main(_eval(model, data, tmp_path / "e")) == 2
    assert _last_line(capsys) == f"vlrft eval: data error: {data}:2 {SURROGATE_MESSAGE}"
    assert not (tmp_path / "e").exists()

    run = ["data.eval_source=", f"model.path={model}", "train.max_steps=1", "logging.wandb=disabled"]
    policy = ["train-policy", f"data.train_source={data}", "rollout.rollout_batch_size=1", *run]
    assert main([*policy, f"train.output_dir={tmp_path / 'p'}"]) == 2
    assert capsys.readouterr().err == f"vlrft train-policy: data error: {data}:2 {SURROGATE_MESSAGE}\n"
    assert not (tmp_path / "p").exists()  # refused by preflight, before the run folder or the model
    assert main(["train-sft", f"data.train_source={data}", *run, f"train.output_dir={tmp_path / 's'}"]) == 2
    assert _last_line(capsys) == f"vlrft train-sft: data error: {data}:2 {SURROGATE_MESSAGE}"  # (its chat records
    # are read by the run, after the model loads: preflight does not decode their images twice)

    # the Geometry3K converter reads its data.json files through the same check
    problem = tmp_path / "geo3k" / "test" / "2401"
    problem.mkdir(parents=True)
    (problem / "data.json").write_text('{"problem_text": "Find x \\udc00.", "choices": ["1", "2"], "answer": "A"}')
    geo3k = ["eval", "--benchmark", "geo3k", "--model", str(model), "--data", str(tmp_path / "geo3k")]
    assert main([*geo3k, "--out", str(tmp_path / "e")]) == 2
    where = f"{problem.parent}:2401 field 'problem_text'"
    assert _last_line(capsys).startswith(f"vlrft eval: data error: {where}: a lone surrogate (\\udc00) at character 8;")

    # a surrogate pair is one valid character (an emoji), read as it is
    _jsonl(data, [GOOD, {"id": "q2", "prompt": "Count the \ud83d\ude00 faces", "answer": "1"}])
    assert "\\ud83d\\ude00" in data.read_text()
    records, _ = read_records(data, "prompt")
    assert records[1].prompt == "Count the \U0001f600 faces"


def test_duplicate_ids_in_eval_data_name_the_file_the_id_and_both_lines(tiny_model, tmp_path, capsys):
    """Issue 23, item 7.2: duplicate ids were a ValueError traceback after the model had loaded, naming
    neither the file nor the lines ("'q1' appears twice")."""
    rows = [GOOD, {"id": "q2", "prompt": "2+2?", "answer": "4"}, {"id": "q1", "prompt": "3+3?", "answer": "6"}]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    assert main(_eval(tiny_model("qwen2"), data, tmp_path / "e")) == 2
    assert _last_line(capsys) == (
        f"vlrft eval: data error: {data}:3 field 'id': id 'q1' is also the id of {data}:1; ids must be unique "
        "(results are kept by id): give each record its own"
    )
    assert not (tmp_path / "e").exists()
    # train-policy's held-out set is evaluated by the same harness: refused in its preflight, before the run folder
    run = ["train-policy", f"model.path={tiny_model('qwen2')}", f"data.train_source={data}", f"data.eval_source={data}"]
    assert (
        main(
            [
                *run,
                "rollout.rollout_batch_size=2",
                "reward.sources=[{name: e, kind: verifier, verifier: exact_match}]",
                f"train.output_dir={tmp_path / 'run'}",
            ]
        )
        == 2
    )
    assert _last_line(capsys) == (
        f"vlrft train-policy: data error: {data}:3 field 'id': id 'q1' is also the id of {data}:1; ids must be "
        "unique (results are kept by id): give each record its own"
    )
    assert not (tmp_path / "run").exists()


def test_eval_out_holding_results_of_other_settings_is_refused_naming_them(tiny_model, tmp_path, capsys):
    """Issue 23, item 7.3: an ``--out`` whose results were made with another model, benchmark or sampling was
    a ValueError traceback (after loading the model); a folder with another tool's samples.jsonl (a train-policy
    run folder) had that file deleted without a word. Same settings still resume; --overwrite starts over."""
    model, out = tiny_model("qwen2"), tmp_path / "e"
    data = _jsonl(tmp_path / "d.jsonl", [GOOD, {"id": "q2", "prompt": "2+2?", "answer": "4"}])
    assert main(_eval(model, data, out)) == 0
    samples = (out / "samples.jsonl").read_bytes()
    assert len(samples.splitlines()) == 2
    assert main(_eval(model, data, out, "--batch-size", "1")) == 0  # same settings: resumes, nothing redone
    assert (out / "samples.jsonl").read_bytes() == samples
    capsys.readouterr()

    other_model = shutil.copytree(model, tmp_path / "other-model")
    assert main(_eval(other_model, data, out, "--temperature", "0.7")) == 2
    assert capsys.readouterr().err == (
        f"vlrft eval: run folder error: --out {out}: holds results made with other settings (temperature: 0.0 -> "
        f"0.7, model: '{model}' -> '{other_model}'); use another --out, or --overwrite to discard them (or remove "
        "the folder)\n"
    )
    assert (out / "samples.jsonl").read_bytes() == samples
    assert main(_eval(other_model, data, out, "--temperature", "0.7", "--overwrite")) == 0
    assert json.loads((out / "run.json").read_text())["temperature"] == 0.7
    capsys.readouterr()

    run = tmp_path / "policy-run"  # a train-policy run folder: samples.jsonl, no run.json
    shutil.copytree(model, run / "final")
    (run / "samples.jsonl").write_text('{"step": 1, "prompt": "Which colour?", "response": "red"}\n')
    assert main(_eval(run, data, run)) == 2
    assert capsys.readouterr().err == (
        f"vlrft eval: run folder error: --out {run}: holds samples.jsonl but no run.json, so not results of vlrft "
        f"eval (a training run's samples?); use another --out, or --overwrite to replace {run / 'samples.jsonl'}\n"
    )
    assert (run / "samples.jsonl").read_text().startswith('{"step": 1')


def test_a_prompt_longer_than_the_models_positions_is_refused_before_generating(tiny_model, tmp_path, capsys):
    """Issue 23, item 7.4: a prompt past max_position_embeddings was generated anyway (minutes on a CPU, a
    transformers warning, a silent 0); now every prompt is counted up front, without reading images."""
    model = tiny_model("qwen2")
    limit = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    long_prompt = "Count the words. " + "apple banana cherry " * 1500
    data = _jsonl(tmp_path / "d.jsonl", [GOOD, {"id": "huge", "prompt": long_prompt, "answer": "4500"}])
    chat = [{"role": "user", "content": long_prompt}]
    tokens = len(load_processor(model).apply_chat_template(chat, add_generation_prompt=True)["input_ids"])
    assert tokens > limit == 4096
    assert main(_eval(model, data, tmp_path / "e")) == 2
    assert _last_line(capsys) == (
        f"vlrft eval: data error: record 'huge' field 'prompt': prompt has {tokens} tokens > the model's "
        f"max_position_embeddings {limit}"
    )
    assert not (tmp_path / "e").exists()

    # a vision-language model: the text alone is too long; its image is never read (it does not exist)
    vl_model = tiny_model("qwen2_5_vl")
    vl_limit = json.loads((vl_model / "config.json").read_text())["text_config"]["max_position_embeddings"]
    pictured = {"id": "pic", "prompt": "<image>" + long_prompt, "images": ["no-such.png"], "answer": "4500"}
    _jsonl(data, [GOOD, pictured])
    assert main(_eval(vl_model, data, tmp_path / "e")) == 2
    line = _last_line(capsys)
    assert line.startswith("vlrft eval: data error: record 'pic' field 'prompt': prompt has ")
    assert line.endswith(f" tokens (not counting its 1 image(s)) > the model's max_position_embeddings {vl_limit}")


def test_eval_reward_model_given_a_run_folder_names_its_final_model(tiny_model, tmp_path, capsys):
    """Issue 23, item 7.5: a train-reward-model run folder given as MODEL (no reward head at its top) was taken
    for a judge: preference pairs failed as "field 'target': missing field", synthetic data and --benchmark
    scored the backbone as a judge. It is refused with the folder to use, as train-policy does for model.path."""
    run = tmp_path / "rm-run"
    shutil.copytree(tiny_model("qwen2"), run / "final")
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    pairs = _jsonl(tmp_path / "pairs.jsonl", [{"id": "p", "prompt": "Which colour?", "chosen": "red", "rejected": "b"}])
    capsys.readouterr()
    for data in ([str(pairs)], ["synthetic:color", "--synthetic-size", "2"], [str(pairs), "--benchmark", "records"]):
        assert main(["eval-reward-model", str(run), *data]) == 2
        assert capsys.readouterr().err == (
            f"vlrft eval-reward-model: config error: model={run}: no config.json in this folder; use {run / 'final'}\n"
        )


def test_a_text_only_reward_model_given_image_records_is_one_line_before_anything_loads(tmp_path, capsys):
    """Issue 23, item 7: ``train-reward-model model.tiny_arch=qwen2`` on its default (synthetic, image) data was a
    ValueError traceback from the encoder after the model was built; a file of image pairs too."""
    out = tmp_path / "run"
    assert main(["train-reward-model", "model.tiny_arch=qwen2", f"train.output_dir={out}"]) == 2
    assert _last_line(capsys) == (
        "vlrft train-reward-model: config error: data.train_source=synthetic:color: synthetic records carry images, "
        "but the model (model.tiny_arch=qwen2) is text-only; use a vision-language model (e.g. "
        "model.tiny_arch=qwen2_5_vl) or text records of your own"
    )
    pairs = _jsonl(
        tmp_path / "p.jsonl", [{"id": "p1", "prompt": "<image>?", "images": ["a.png"], "chosen": "x", "rejected": "y"}]
    )
    args = ["train-reward-model", "model.tiny_arch=qwen2", f"data.train_source={pairs}", "data.eval_source="]
    assert main([*args, f"train.output_dir={out}"]) == 2
    assert _last_line(capsys) == (
        f"vlrft train-reward-model: data error: {pairs}:1 field 'images': record 'p1' has 1 image(s), but the model "
        "(model.tiny_arch=qwen2) is text-only"
    )
    assert not out.exists()


def test_a_text_only_policy_sft_or_dpo_model_on_a_synthetic_task_is_one_line_before_anything_loads(
    tiny_model, tmp_path, capsys
):
    """The reward model's rule above for the other trainers: ``train-policy`` of a text-only model on its embedded
    demo (the synthetic colour task, images) was a ``ValueError`` traceback from the prompt-length filter after the
    run folder and the model were made; ``train-sft`` and ``train-dpo`` likewise."""
    text = tiny_model("qwen2")
    capsys.readouterr()  # (the tiny model's build)
    for command in ("train-policy", "train-sft", "train-dpo"):
        out = tmp_path / command
        assert main([command, f"model.path={text}", f"train.output_dir={out}"]) == 2, command
        assert capsys.readouterr().err == (
            f"vlrft {command}: config error: data.train_source=synthetic:color: synthetic records carry images, but "
            f"the model (model.path={text}) is text-only; use a vision-language model (e.g. "
            "model.tiny_arch=qwen2_5_vl) or text records of your own\n"
        ), command
        assert not out.exists()


def _llama_folder(tiny_model, tmp_path) -> Path:
    """A real model folder of an architecture vlrft does not train: a tiny random Llama with the tiny tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "llama"
    text = tiny_model("qwen2")
    sizes = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    LlamaForCausalLM(LlamaConfig(vocab_size=1024, **sizes)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(text / name, folder / name)
    return folder


def test_a_model_of_an_architecture_vlrft_does_not_train_is_one_line_naming_it_and_those_it_does(
    tiny_model, tmp_path, capsys, monkeypatch
):
    """Issue 60, bad input: a model folder of another architecture (here a real tiny Llama) given to each trainer is
    one line naming its ``model_type`` and the architectures vlrft trains, before the run folder (it used to be a
    traceback from the data, or a run of paths never proven on it). A hub id not at hand is read when it loads:
    ``load_model(..., trains=KEY)`` says the same before any weight loads. An architecture vlrft trains that the
    installed transformers lacks names the transformers to get."""
    from vlrft.archs import ARCHS
    from vlrft.config import ConfigError
    from vlrft.models import loading

    llama = _llama_folder(tiny_model, tmp_path)
    capsys.readouterr()  # (save_pretrained's progress)
    line = (
        f"model.path={llama}: architecture 'llama' (config.json's model_type) is not one vlrft trains; it trains "
        f"{', '.join(ARCHS)}"
    )
    for command in ("train-policy", "train-sft", "train-dpo", "train-reward-model"):
        out = tmp_path / command
        assert main([command, f"model.path={llama}", f"train.output_dir={out}"]) == 2, command
        # the last line (train-reward-model's default learning rate is a real model's: its warning comes first)
        assert _last_line(capsys) == f"vlrft {command}: config error: {line}", command
        assert not out.exists()
    with pytest.raises(ConfigError) as caught:
        loading.load_model(llama, trains="model.path")
    assert str(caught.value) == line
    monkeypatch.setattr(loading, "ARCHS", tuple(a for a in ARCHS if a != "qwen2_5_vl"))
    with pytest.raises(ConfigError, match=r"^model.path=m: architecture 'qwen2_5_vl' needs a newer transformers than"):
        loading.check_trainable("qwen2_5_vl", "model.path=m")


def test_a_stale_deepspeed_build_lock_is_one_line_not_a_silent_wait(tiny_model, tmp_path, capsys, monkeypatch):
    """A DeepSpeed op build killed mid-way leaves ``<TORCH_EXTENSIONS_DIR>/<op>/lock``, and every later DeepSpeed
    run waited on it forever, idle and silent (seen: three distributed tests of a CI run hung after an earlier run
    was killed). A lock older than any build is now one line naming it; a fresh one (a build running) is left be."""
    import os
    import time

    from vlrft.strategies.deepspeed import STALE_BUILD_LOCK_S, check_build_locks

    lock = tmp_path / "ext" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    check_build_locks(tmp_path / "ext")  # a build holds it now: no error
    old = time.time() - STALE_BUILD_LOCK_S - 60
    os.utime(lock, (old, old))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    run = [f"model.path={tiny_model('qwen2_5_vl')}", "data.train_source=synthetic:color", "data.eval_source="]
    run += ["strategy.name=deepspeed", "train.max_steps=1", "logging.wandb=disabled"]
    run += [f"train.output_dir={tmp_path / 'r'}"]
    assert main(["train-sft", *run]) == 2
    line = _last_line(capsys)
    assert line.startswith(f"vlrft train-sft: error: {lock} is a build lock 21 minutes old"), line
    assert line.endswith(f"Remove it (rm {lock}) if no build is running, and run again"), line
