"""Values that make no sense are refused at load, each error naming the key, the value and the rule
(issue 11: "Values that make no sense are accepted silently", "Late and misleading errors")."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

from reward_models.config import RewardModelTrainConfig
from vlrft.cli import main
from vlrft.config import ConfigError, load_config
from vlrft.config_help import describe
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.preflight import preflight_policy

REPO = Path(__file__).resolve().parents[1]


def _refused(overrides: list[str], path=None) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(PolicyTrainConfig, path, overrides)
    return str(err.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.temperature=0", "rollout.temperature=0.0: must be > 0 for training"),
        ("rollout.temperature=-1", "rollout.temperature=-1.0: must be > 0 for training"),
        ("rollout.temperature=.nan", "rollout.temperature=nan: not finite; must be > 0 for training"),
        ("algorithm.kl_coef=-0.5", "algorithm.kl_coef=-0.5: must be >= 0"),
        ("algorithm.clip_high=-0.1", "algorithm.clip_high=-0.1: must be >= 0"),
        ("algorithm.clip_low=1.5", "algorithm.clip_low=1.5: must be >= 0 and <= 1"),
        ("algorithm.clip_low=-0.2", "algorithm.clip_low=-0.2: must be >= 0 and <= 1"),
        ("rollout.top_p=0", "rollout.top_p=0.0: must be > 0 and <= 1"),
        ("rollout.top_p=2", "rollout.top_p=2.0: must be > 0 and <= 1"),
        ("train.micro_train_batch_size=0", "train.micro_train_batch_size=0: must be >= 1"),
        ("train.max_steps=-3", "train.max_steps=-3: must be >= 0"),
        ("rollout.max_new_tokens=0", "rollout.max_new_tokens=0: must be >= 1"),
        ("rollout.rollout_batch_size=0", "rollout.rollout_batch_size=0: must be >= 1"),
        ("algorithm.gamma=1.5", "algorithm.gamma=1.5: must be >= 0 and <= 1"),
        ("algorithm.entropy_coef=.inf", "algorithm.entropy_coef=inf: must be finite"),
        ("optim.lr=1e-5", None),  # accepted: a sane value still loads
    ],
)
def test_a_value_out_of_range_names_key_value_and_rule(override, message):
    if message is None:
        assert load_config(PolicyTrainConfig, None, [override]).optim.lr == 1e-5
        return
    assert _refused([override]) == message


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "cpgd", "reinforce_plus_plus_baseline"])
def test_group_estimators_refuse_one_sample_per_prompt(estimator):
    msg = _refused([f"algorithm.advantage_estimator={estimator}", "rollout.n_samples_per_prompt=1"])
    assert msg.startswith(f"rollout.n_samples_per_prompt=1: must be >= 2 for algorithm.advantage_estimator={estimator}")
    assert "reinforce_plus_plus" in msg  # says what to do


def test_one_sample_per_prompt_is_fine_without_a_group_baseline():
    cfg = load_config(
        PolicyTrainConfig, None, ["algorithm.advantage_estimator=reinforce_plus_plus", "rollout.n_samples_per_prompt=1"]
    )
    assert cfg.rollout.n_samples_per_prompt == 1


@pytest.mark.parametrize("field", ["weight", "fallback"])
def test_reward_weight_and_fallback_must_be_finite(tmp_path, field):
    cfg = tmp_path / "r.yaml"
    cfg.write_text(
        "reward:\n  sources:\n    - name: acc\n      kind: verifier\n"
        f"      verifier: vocab_answer\n      {field}: .nan\n"
    )
    assert _refused([], cfg) == f"reward.sources[0].{field}=nan: must be finite"


def test_a_recipe_weight_must_be_finite(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text(
        "reward:\n  sources:\n    - name: acc\n      verifier: vocab_answer\n  recipes:\n    default: {acc: .inf}\n"
    )
    assert "reward.recipes.default.acc=inf: must be finite" in _refused([], cfg)


def test_rollout_batch_must_divide_over_the_ranks_before_any_model_loads(tmp_path):
    cfg = load_config(PolicyTrainConfig, None, ["rollout.rollout_batch_size=3", f"train.output_dir={tmp_path}/out"])
    with pytest.raises(
        ConfigError, match=r"rollout.rollout_batch_size=3: must be divisible by the number of processes \(2\)"
    ):
        preflight_policy(cfg, world=2)
    assert not (tmp_path / "out").exists()  # nothing was built or written
    preflight_policy(cfg, world=1)  # one process takes any batch


def test_the_world_size_comes_from_the_launcher(tmp_path, monkeypatch):
    cfg = load_config(PolicyTrainConfig, None, ["rollout.rollout_batch_size=3", f"train.output_dir={tmp_path}/out"])
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc_per_node=2 sets it
    with pytest.raises(ConfigError, match=r"rollout.rollout_batch_size=3: must be divisible .* \(2\)"):
        preflight_policy(cfg)


@pytest.mark.parametrize(
    "value", ["{prompt} Answer with one word.", "Q: {prompt}\nA:", "{prompt} (answer: one word, {{no}} braces)"]
)
def test_a_dotted_override_with_braces_or_colons_is_a_plain_string(value):
    cfg = load_config(PolicyTrainConfig, None, [f"data.prompt_template={value}", "data.system_prompt=Role: tutor"])
    assert cfg.data.prompt_template == value and cfg.data.system_prompt == "Role: tutor"


def test_a_template_without_prompt_or_with_other_fields_is_refused_before_loading(tmp_path):
    for value, found in (("Answer with one word.", "none"), ("{prompt} {answer}", "['answer', 'prompt']")):
        cfg = load_config(PolicyTrainConfig, None, [f"data.prompt_template={value}", f"train.output_dir={tmp_path}"])
        with pytest.raises(ConfigError, match=re.escape(f"(found {found})")):
            preflight_policy(cfg, world=1)


def test_wrong_types_still_name_the_key():
    assert "train.max_steps" in _refused(["train.max_steps=abc"])
    assert "unknown config key 'rollout.temprature'" in _refused(["rollout.temprature=1"])


def test_help_shows_the_ranges():
    lines = "\n".join(describe(PolicyTrainConfig))
    assert "rollout.temperature (float, > 0, default 1.0)" in lines
    assert "rollout.top_p (float, > 0 and <= 1, default 1.0)" in lines


def test_every_shipped_config_still_loads():
    for path in sorted(glob.glob(str(REPO / "configs" / "policy" / "*.yaml"))) + [
        str(REPO / "vlrft" / "trainer" / "demo.yaml")
    ]:
        # a recipe whose required key is left for the user (opd's teacher.path) loads once it is given
        needs = ["teacher.path=a-teacher"] if Path(path).stem.startswith("opd") else []
        load_config(PolicyTrainConfig, path, needs)
    with pytest.raises(ConfigError, match="needs a teacher"):
        load_config(PolicyTrainConfig, str(REPO / "configs" / "policy" / "opd.yaml"))
    for path in sorted(glob.glob(str(REPO / "configs" / "reward_model" / "*.yaml"))):
        load_config(RewardModelTrainConfig, path)


@pytest.mark.parametrize(
    "override, message",
    [
        ("loss.log_theta=0", "loss.log_theta=0.0: must be > 0"),
        ("data.eval_fraction=1", "data.eval_fraction=1.0: must be >= 0 and < 1"),
        ("train.log_every=0", "train.log_every=0: must be >= 1"),
        ("train.batch_size=0", "train.batch_size=0: must be >= 1"),
        ("judge.score_max=0", "judge.score_max=0.0: must be > 0"),
        ("logging.log_every_s=-1", "logging.log_every_s=-1.0: must be >= 0"),
    ],
)
def test_reward_model_values_out_of_range_name_key_value_and_rule(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(RewardModelTrainConfig, None, [override])
    assert str(err.value) == message


def test_the_ranges_example_in_docs_configs_runs_as_written(capsys):
    text = (REPO / "docs" / "configs.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "rollout.temperature=-1" in b)
    exec(compile(block, "docs/configs.md", "exec", dont_inherit=True), {"__name__": "docs_example"})
    assert capsys.readouterr().out == "rollout.temperature=-1.0: must be > 0 for training\n"


CONFIG_COMMANDS = ["train-policy", "train-sft", "train-dpo", "train-reward-model"]


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
def test_a_folder_given_as_config_says_it_is_a_folder(command, tmp_path, capsys):
    """Issue 23, item 7 (smaller list, 4): a folder given as the config said "does not exist"; it now says it
    is a folder, that a YAML file is needed and which YAML files it holds. A missing file still does not exist."""
    folder = tmp_path / "configs"
    folder.mkdir()
    assert main([command, str(folder)]) == 2
    assert capsys.readouterr().err == (
        f"vlrft {command}: config error: config file {folder}: is a folder; a config must be a YAML file "
        "(it holds no YAML file)\n"
    )
    for name in ("b.yaml", "a.yml", "c.yaml", "d.yaml", "e.yaml", "notes.txt"):
        (folder / name).write_text("{}\n")
    assert main([command, str(folder), "train.max_steps=1"]) == 2
    assert capsys.readouterr().err == (
        f"vlrft {command}: config error: config file {folder}: is a folder; a config must be a YAML file "
        "(YAML files in it: a.yml, b.yaml, c.yaml, d.yaml, ...)\n"
    )
    assert main([command, str(tmp_path / "none.yaml")]) == 2
    assert (
        capsys.readouterr().err
        == f"vlrft {command}: config error: config file {tmp_path / 'none.yaml'} does not exist\n"
    )


SFT_MODEL_KEYS = "path, tiny_arch, tiny_hidden, tiny_layers, dtype"


@pytest.mark.parametrize(
    "command, yaml_text, override, shown",
    [
        (
            "train-sft",
            "model: [a, b]\n",
            None,
            f"'model' = ['a', 'b'] (list): must be a mapping of the section's keys ({SFT_MODEL_KEYS})",
        ),
        ("train-sft", "model:\n", None, f"'model' = null: must be a mapping of the section's keys ({SFT_MODEL_KEYS})"),
        (
            "train-sft",
            None,
            "model=3",
            f"'model' = 3 (int): must be a mapping of the section's keys ({SFT_MODEL_KEYS})",
        ),
        ("train-dpo", "train: 3\n", None, "'train' = 3 (int): must be a mapping of the section's keys (output_dir, "),
        (
            "train-policy",
            "rollout:\n  vllm: auto\n",
            None,
            "'rollout.vllm' = 'auto' (str): must be a mapping of the section's keys (gpu_memory_utilization, ",
        ),
        ("train-reward-model", "loss: [1]\n", None, "'loss' = [1] (list): must be a mapping of the section's keys ("),
    ],
)
def test_a_section_given_a_list_or_a_value_names_its_key(command, yaml_text, override, shown, tmp_path, capsys):
    """Issue 23, item 7 (smaller list, 5): a list or a value given for a section (YAML ``model: [a, b]``,
    ``train: 3``, a nested ``rollout.vllm``, or an override ``model=3``) named the key '?'; it now names the
    section's key, the value and the rule (a mapping of the section's keys, which it lists)."""
    if yaml_text is not None:
        path = tmp_path / "c.yaml"
        path.write_text(yaml_text)
        argv, source = [command, str(path)], str(path)
    else:
        argv, source = [command, override], f"command-line override {override!r}"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vlrft {command}: config error: {source}: config key {shown}") and "'?'" not in err
    assert err.endswith(")\n") and err.count("\n") == 1


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
def test_keep_last_below_one_is_refused_by_every_trainer(command, tmp_path, capsys):
    """Issue 23, item 7 (smaller list, 6): ``train.keep_last=-3`` was accepted and treated as 1. The one run
    section (``vlrft/loop.py`` ``RunConfig``, ``ge=1``) refuses it, and 0, for every trainer, from the command
    line and from a YAML file; 1 is accepted."""
    for value in ("-3", "0"):
        assert main([command, f"train.keep_last={value}", "--print-config"]) == 2
        assert capsys.readouterr().err == f"vlrft {command}: config error: train.keep_last={value}: must be >= 1\n"
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  keep_last: -3\n")
    assert main([command, str(path), "--print-config"]) == 2
    assert capsys.readouterr().err == f"vlrft {command}: config error: train.keep_last=-3: must be >= 1\n"
    assert main([command, "train.keep_last=1", "--print-config"]) == 0
    assert "  keep_last: 1\n" in capsys.readouterr().out
