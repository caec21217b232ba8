"""Each reward source kind has its own config (a tagged union under ``kind``): configs written for the flat
33-key source config load to the same values, a key of another kind is a one-line error naming the kind's keys,
and ``--print-config`` / ``--help`` show the keys of the kinds in use only."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

from data_pipelines.formatting import JUDGE_SYSTEM_PROMPT, POINTWISE_JUDGE_TEMPLATE
from data_pipelines.records import PromptRecord
from reward_models.kinds import SOURCE_CONFIG, SOURCE_KINDS, source_config
from reward_models.pool import RewardPool, RewardPoolConfig
from reward_models.serve import ServeConfig
from vlrft.cli import main
from vlrft.config import ConfigError, load_config
from vlrft.trainer.config import PolicyTrainConfig

# the flat source config every kind shared before (reward_models/pool.py), key -> default
FLAT_DEFAULTS = {
    "name": "",
    "kind": "verifier",
    "verifier": "",
    "verifier_options": {},
    "path": "",
    "weight": 1.0,
    "fallback": None,
    "micro_batch_size": 8,
    "max_length": 4096,
    "max_new_tokens": 32,
    "judge_template": POINTWISE_JUDGE_TEMPLATE,
    "judge_system_prompt": JUDGE_SYSTEM_PROMPT,
    "unparsable_reward": 0.0,
    "score_max": 1.0,
    "judge_mode": "pointwise",
    "pairwise_against": "group",
    "debias": "none",
    "engine": "hf",
    "function": "",
    "signature": "sample",
    "function_kwargs": {},
    "needs": [],
    "isolation": "process",
    "timeout_s": 30.0,
    "num_workers": 2,
    "memory_limit_mb": 4096,
    "url": "",
    "model": "",
    "api_key_env": "",
    "max_retries": 3,
    "max_concurrency": 4,
    "http_batch_size": 64,
    "max_failure_share": 0.5,
}
COMMON = ["name", "kind", "weight", "fallback", "max_failure_share"]
JUDGE = ["max_new_tokens", "judge_template", "judge_system_prompt", "unparsable_reward", "score_max", "judge_mode"]
REMOTE = ["url", "api_key_env", "timeout_s", "max_retries", "max_concurrency"]
# the keys each kind reads (its help text named them so before): what a config of that kind may set
KIND_KEYS = {
    "verifier": COMMON + ["verifier", "verifier_options"],
    "srm": COMMON + ["path", "micro_batch_size", "max_length"],
    "grm": COMMON + JUDGE + ["path", "micro_batch_size", "pairwise_against", "debias", "engine"],
    "function": COMMON
    + ["function", "signature", "function_kwargs", "needs", "isolation", "timeout_s", "num_workers", "memory_limit_mb"],
    "http": COMMON + REMOTE + ["http_batch_size"],
    "openai_judge": COMMON + REMOTE + JUDGE + ["model"],
}
# a value other than the default for every key (a valid choice where the key has choices)
SET = {
    "verifier": "exact_match",
    "verifier_options": {"lenient": True},
    "path": "/models/rm",
    "weight": 0.25,
    "fallback": -1.0,
    "micro_batch_size": 3,
    "max_length": 512,
    "max_new_tokens": 12,
    "judge_template": "Is {response} right for {prompt}?",
    "judge_system_prompt": "",
    "unparsable_reward": -0.5,
    "score_max": 10.0,
    "judge_mode": "pairwise",
    "pairwise_against": "reference",
    "debias": "swap",
    "engine": "vllm",
    "function": "my/reward.py:score",
    "signature": "batch",
    "function_kwargs": {"strict": True},
    "needs": ["answer"],
    "isolation": "inline",
    "timeout_s": 5.0,
    "num_workers": 3,
    "memory_limit_mb": 1024,
    "url": "http://10.0.0.5:8100",
    "model": "my-judge",
    "api_key_env": "JUDGE_KEY",
    "max_retries": 1,
    "max_concurrency": 2,
    "http_batch_size": 16,
    "max_failure_share": 0.75,
}


def _fields(cfg) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def test_every_key_of_the_flat_config_belongs_to_a_kind_with_its_default():
    assert set(SOURCE_KINDS) == set(KIND_KEYS)
    assert set().union(*KIND_KEYS.values()) == set(FLAT_DEFAULTS)
    for kind, keys in KIND_KEYS.items():
        cfg = source_config(kind=kind)
        assert sorted(_fields(cfg)) == sorted(keys), kind
        assert _fields(cfg) == {k: kind if k == "kind" else FLAT_DEFAULTS[k] for k in keys}, kind
    # a key has one type in every kind that has it (a `source.key=value` override is read by that type)
    hints = {kind: typing.get_type_hints(SOURCE_CONFIG.variants[kind]) for kind in KIND_KEYS}
    for key in FLAT_DEFAULTS:
        types = {hints[kind][key] for kind, keys in KIND_KEYS.items() if key in keys}
        assert len(types) == 1, (key, types)


@pytest.mark.parametrize("kind", list(KIND_KEYS))
def test_a_config_of_each_kind_written_as_before_loads_to_the_same_values(kind, tmp_path):
    source = {"name": "s", "kind": kind, **{k: SET[k] for k in KIND_KEYS[kind] if k in SET}}
    path = tmp_path / "reward.yaml"
    path.write_text(yaml.safe_dump({"reward": {"sources": [source]}}))
    (cfg,) = load_config(PolicyTrainConfig, path).reward.sources
    assert type(cfg) is SOURCE_KINDS[kind].config
    assert _fields(cfg) == source
    # the same source as a command-line override, and as the served source of vlrft serve-reward-model
    flow = yaml.safe_dump([source], default_flow_style=True, width=10_000).strip()
    (again,) = load_config(RewardPoolConfig, None, [f"sources={flow}"]).sources
    assert again == cfg
    served = [f"source.{k}={_as_override(v)}" for k, v in source.items()]
    assert load_config(ServeConfig, None, served).source == cfg


def _as_override(value) -> str:
    """A value as written after ``key=`` (text as it is; numbers, lists and mappings as YAML)."""
    return (
        value
        if isinstance(value, str)
        else yaml.safe_dump(value, default_flow_style=True).removesuffix("...\n").strip()
    )


def test_a_source_without_kind_is_a_verifier_and_the_default_pool_is_the_demos():
    (cfg,) = load_config(RewardPoolConfig, None, ["sources=[{name: acc, verifier: gsm8k}]"]).sources
    assert _fields(cfg) == {**{k: FLAT_DEFAULTS[k] for k in KIND_KEYS["verifier"]}, "name": "acc", "verifier": "gsm8k"}
    assert [s.verifier for s in load_config(PolicyTrainConfig).reward.sources] == ["vocab_answer"]


def test_a_key_of_another_kind_is_one_line_naming_the_kind_and_its_keys(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        "reward:\n  sources:\n    - {name: acc, kind: verifier, verifier: vocab_answer, path: /models/rm}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(PolicyTrainConfig, path)
    message = str(err.value)
    assert message == (
        f"{path}: unknown config key 'reward.sources[0].path' = '/models/rm' for a reward source of kind verifier "
        "('path' is a key of kinds srm, grm); keys of kind verifier: name, kind, weight, fallback, "
        "max_failure_share, verifier, verifier_options"
    )
    # a misspelt key of its own kind: a did-you-mean; an override names itself
    with pytest.raises(
        ConfigError,
        match=r"command-line override .* 'reward.sources\[0\].wieght' = 2 .* kind "
        r"srm; did you mean 'weight'\? keys of kind srm: name, kind, .*, max_length$",
    ):
        load_config(PolicyTrainConfig, None, ["reward.sources=[{name: rm, kind: srm, path: /r, wieght: 2}]"])
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'source.verifier' = 'x' for a reward source of kind "
        "http",
    ):
        load_config(ServeConfig, None, ["source.verifier=x", "source.kind=http"])
    # the CLI prints the one line and exits 2
    assert main(["train-policy", "--print-config", str(path)]) == 2


def test_types_and_choices_of_a_kind_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"bad value for config key 'sources\[0\].micro_batch_size'"):
        load_config(RewardPoolConfig, None, ["sources=[{name: rm, kind: srm, micro_batch_size: many}]"])
    with pytest.raises(ConfigError, match=r"'sources\[1\].debias' = 'both' is not allowed; choose one of: none, swap"):
        load_config(RewardPoolConfig, None, ["sources=[{name: a}, {name: j, kind: grm, debias: both}]"])
    with pytest.raises(ConfigError, match=r"^source.timeout_s=0.0: must be > 0$"):
        load_config(ServeConfig, None, ["source.kind=function", "source.timeout_s=0"])
    with pytest.raises(ConfigError, match=r"'sources\[0\]' = 'acc': must be a mapping of a reward source's keys"):
        load_config(RewardPoolConfig, None, ["sources=[acc]"])
    # an override of a key of the served source is read by its type, whatever the order of kind and key
    served = load_config(ServeConfig, None, ["source.path=0612", "source.kind=srm", "source.name=no"]).source
    assert (served.kind, served.path, served.name) == ("srm", "0612", "no")


def test_print_config_of_a_verifier_pool_shows_only_the_verifiers_keys(capsys):
    assert main(["train-policy", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    (source,) = printed["reward"]["sources"]
    assert list(source) == KIND_KEYS["verifier"]
    assert source["kind"] == "verifier" and source["verifier"] == "vocab_answer"

    with pytest.raises(SystemExit):
        main(["train-policy", "--help"])
    text = capsys.readouterr().out
    assert "reward.sources[].verifier_options (dict, default {})" in text
    assert "reward.sources[].path" not in text and "reward.sources[].url" not in text  # kinds not in use: one line
    assert (
        "    kind srm: A scalar reward model: one value per response. Keys: path, micro_batch_size, max_length" in text
    )


def test_the_pool_lends_its_threads_to_its_sources_at_construction():
    cfg = load_config(RewardPoolConfig, None, ["sources=[{name: acc, verifier: exact_match}]", "device=cpu"])
    pool = RewardPool(cfg)
    try:
        assert pool.sources["acc"].executor is not None  # given by the pool's factory, not set from outside
        out = pool.score([PromptRecord(id="r", prompt="?", answer="red")] * 2, ["red", "blue"])
        assert out.per_source["acc"].tolist() == [1.0, 0.0]
    finally:
        pool.close()


def test_a_config_yaml_written_with_the_flat_keys_still_loads_with_one_warning(tmp_path, caplog):
    """A run folder's config.yaml written before each kind had its own keys lists all 33 for every source; the
    other kinds' keys at their defaults carry nothing and are dropped, counted in one warning; one set to another
    value is still the one-line error."""
    path = tmp_path / "config.yaml"
    flat = {**FLAT_DEFAULTS, "name": "accuracy", "verifier": "vocab_answer"}
    path.write_text(yaml.safe_dump({"reward": {"sources": [flat]}}))
    with caplog.at_level("WARNING"):
        (cfg,) = load_config(PolicyTrainConfig, path).reward.sources
    assert _fields(cfg) == {k: flat[k] for k in KIND_KEYS["verifier"]}
    (warning,) = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    foreign = len(FLAT_DEFAULTS) - len(KIND_KEYS["verifier"])
    assert warning.startswith(f"{path}: {foreign} keys of other kinds at their defaults dropped from kind verifier")
    path.write_text(yaml.safe_dump({"reward": {"sources": [{**flat, "num_workers": 3}]}}))
    with pytest.raises(ConfigError, match=r"unknown config key 'reward.sources\[0\].num_workers' = 3 "):
        load_config(PolicyTrainConfig, path)
