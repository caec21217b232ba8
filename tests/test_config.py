"""Typed configs: YAML + dotted overrides, errors that name the key, the resolved config saved."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from vlrft.config import ConfigError, load_config, option, save_config
from vlrft.config_help import describe


@dataclass
class AlgorithmSection:
    kl_coef: float = option(0.0, "weight of the KL term")
    advantage_estimator: str = option("grpo", "advantage estimator", choices=("grpo", "rloo"))
    clip: list = option([0.2, 0.28], "clip range (low, high)")

    def validate(self):
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


@dataclass
class RunConfig:
    seed: int = option(0, "random seed")
    name: str = option("run", "run name")
    algorithm: AlgorithmSection = option(AlgorithmSection(), "algorithm options")


def test_yaml_then_overrides_resolve(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 3\nalgorithm:\n  kl_coef: 0.1\n  advantage_estimator: rloo\n")
    cfg = load_config(RunConfig, path, ["algorithm.kl_coef=0.01", "name=exp"])
    assert isinstance(cfg, RunConfig) and isinstance(cfg.algorithm, AlgorithmSection)
    assert (cfg.seed, cfg.name, cfg.algorithm.kl_coef, cfg.algorithm.advantage_estimator) == (3, "exp", 0.01, "rloo")
    assert cfg.algorithm.clip == [0.2, 0.28]
    assert load_config(RunConfig).algorithm.advantage_estimator == "grpo"


def test_resolved_config_is_written_and_reloads_identically(tmp_path):
    cfg = load_config(RunConfig, None, ["algorithm.kl_coef=0.5", "seed=9"])
    saved = save_config(cfg, tmp_path / "run")
    assert saved.name == "config.yaml"
    assert "kl_coef: 0.5" in saved.read_text()
    assert load_config(RunConfig, saved) == cfg


def test_wrong_key_names_the_key_and_suggests(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  klcoef: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, path)
    msg = str(err.value)
    assert str(path) in msg and "algorithm.klcoef" in msg and "did you mean 'kl_coef'" in msg
    with pytest.raises(ConfigError, match=r"override 'algorithm.nope=1'.*'algorithm.nope'"):
        load_config(RunConfig, None, ["algorithm.nope=1"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, ["algorithm.kl_coef=abc"])
    assert "algorithm.kl_coef" in str(err.value) and "abc" in str(err.value)
    with pytest.raises(ConfigError, match="'seed'"):
        load_config(RunConfig, None, ["seed=1.5x"])


def test_disallowed_value_lists_the_choices_and_validate_runs():
    with pytest.raises(ConfigError, match=r"algorithm.advantage_estimator.*'ppo'.*grpo, rloo"):
        load_config(RunConfig, None, ["algorithm.advantage_estimator=ppo"])
    with pytest.raises(ConfigError, match="kl_coef must be >= 0"):
        load_config(RunConfig, None, ["algorithm.kl_coef=-1"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(RunConfig, tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(RunConfig, bad)


def test_describe_lists_every_key_with_help():
    text = "\n".join(describe(RunConfig))
    for key in ("seed", "name", "algorithm.kl_coef", "algorithm.advantage_estimator", "algorithm.clip"):
        assert key in text
    assert "{grpo, rloo}" in text and "weight of the KL term" in text
