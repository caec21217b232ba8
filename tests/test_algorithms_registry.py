"""One registry entry per RL algorithm declares what it needs (group baseline, critic, std normalisations,
extra loss inputs); config validation, preflight and the trainer read the entry, never the name (issue 22)."""

from __future__ import annotations

import pytest
import torch

from vlrft.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    compute_advantages,
    compute_policy_loss,
    register_advantage_estimator,
    register_policy_loss,
)
from vlrft.config import ConfigError, load_config
from vlrft.config_help import describe
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.preflight import preflight_policy


def _refused(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(PolicyTrainConfig, None, overrides)
    return str(err.value)


@pytest.fixture
def registered():
    """Names registered by a test, removed afterwards so that no other test sees them."""
    names: list[tuple[dict, str]] = []
    yield lambda registry, name: names.append((registry, name))
    for registry, name in names:
        registry.pop(name, None)


def _toy_advantages(rewards, response_mask, *, std_normalization="none", **_):
    """Advantage = the reward itself on every valid token (no baseline)."""
    adv = torch.where(response_mask, rewards[:, None].expand(response_mask.shape), torch.zeros(()))
    return adv, adv


def test_the_declarations():
    group = {name for name, spec in ADVANTAGE_ESTIMATORS.items() if spec.group}
    assert group == {"grpo", "rloo", "cpgd", "reinforce_plus_plus_baseline"}
    assert [name for name, spec in ADVANTAGE_ESTIMATORS.items() if spec.critic] == ["gae"]
    assert {name: spec.default_std for name, spec in ADVANTAGE_ESTIMATORS.items()} == {
        "grpo": "group",
        "rloo": "none",
        "reinforce_plus_plus": "batch",
        "reinforce_plus_plus_baseline": "batch",
        "gae": "batch",
        "cpgd": "group",
        "opd": "none",
    }
    assert [name for name, spec in ADVANTAGE_ESTIMATORS.items() if spec.teacher] == ["opd"]
    assert {name: spec.extra_inputs for name, spec in POLICY_LOSSES.items() if spec.extra_inputs} == {
        "cpgd": ("policy_drift_coef",),
        "sapo": ("sapo_tau_pos", "sapo_tau_neg"),
    }


@pytest.mark.parametrize("name", [n for n, spec in ADVANTAGE_ESTIMATORS.items() if spec.group])
def test_a_group_estimator_refuses_one_sample_per_prompt_naming_the_key(name):
    msg = _refused([f"algorithm.advantage_estimator={name}", "rollout.n_samples_per_prompt=1"])
    assert msg.startswith(f"rollout.n_samples_per_prompt=1: must be >= 2 for algorithm.advantage_estimator={name}")


def test_a_std_normalization_the_estimator_does_not_accept_is_refused_at_load():
    msg = _refused(["algorithm.advantage_estimator=gae", "algorithm.std_normalization=group"])
    assert msg == (
        "algorithm.std_normalization=group: does not apply to algorithm.advantage_estimator=gae "
        "(accepted: batch, none; empty picks its default batch)"
    )
    for name, spec in ADVANTAGE_ESTIMATORS.items():
        for norm in spec.std_normalizations:
            overrides = [f"algorithm.advantage_estimator={name}", f"algorithm.std_normalization={norm}"]
            overrides += ["teacher.path=some-teacher"] if spec.teacher else []  # opd: validated, not loaded here
            assert load_config(PolicyTrainConfig, None, overrides).algorithm.std_normalization == norm


def test_gae_declares_a_critic_and_preflight_checks_its_path(tmp_path):
    overrides = [f"critic.path={tmp_path}/no-critic", f"train.output_dir={tmp_path}/out"]
    cfg = load_config(PolicyTrainConfig, None, ["algorithm.advantage_estimator=gae", *overrides])
    assert cfg.algorithm.estimator.critic
    with pytest.raises(ConfigError, match="critic.path=.*no-critic: no such folder"):
        preflight_policy(cfg, world=1)
    cfg = load_config(PolicyTrainConfig, None, ["algorithm.advantage_estimator=grpo", *overrides])
    assert not cfg.algorithm.estimator.critic
    preflight_policy(cfg, world=1)  # no critic is built, so its path is not looked at


def test_a_new_estimator_is_one_function_and_one_entry(registered, tmp_path):
    unknown = _refused(["algorithm.advantage_estimator=toy"])
    assert "'algorithm.advantage_estimator' = 'toy' is not allowed" in unknown

    register_advantage_estimator("toy", group=False, std_normalizations=("none",), default_std="none")(_toy_advantages)
    registered(ADVANTAGE_ESTIMATORS, "toy")
    cfg = load_config(PolicyTrainConfig, None, ["algorithm.advantage_estimator=toy", "rollout.n_samples_per_prompt=1"])
    assert cfg.algorithm.estimator.fn is _toy_advantages
    assert "toy" in "\n".join(describe(PolicyTrainConfig))  # --help lists it
    assert "accepted: none" in _refused(["algorithm.advantage_estimator=toy", "algorithm.std_normalization=batch"])
    mask = torch.tensor([[True, False], [True, True]])
    adv, _ = compute_advantages("toy", torch.tensor([1.0, -2.0]), mask)
    assert adv.tolist() == [[1.0, 0.0], [-2.0, -2.0]]

    # the same function declared with a group baseline and a critic: validation and preflight follow the entry
    register_advantage_estimator(
        "toy_group", group=True, critic=True, std_normalizations=("none",), default_std="none"
    )(_toy_advantages)
    registered(ADVANTAGE_ESTIMATORS, "toy_group")
    msg = _refused(["algorithm.advantage_estimator=toy_group", "rollout.n_samples_per_prompt=1"])
    assert "must be >= 2 for algorithm.advantage_estimator=toy_group" in msg
    cfg = load_config(
        PolicyTrainConfig,
        None,
        ["algorithm.advantage_estimator=toy_group", f"critic.path={tmp_path}/none", f"train.output_dir={tmp_path}/o"],
    )
    with pytest.raises(ConfigError, match="no such folder"):
        preflight_policy(cfg, world=1)


def test_an_entry_is_checked_when_registered():
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_advantage_estimator("grpo", group=True, std_normalizations=("group",), default_std="group")
    with pytest.raises(ValueError, match="contain default_std 'group'"):
        register_advantage_estimator("bad", group=False, std_normalizations=("batch",), default_std="group")
    with pytest.raises(ValueError, match="must be among"):
        register_advantage_estimator("bad", group=False, std_normalizations=("median",), default_std="median")
    with pytest.raises(ValueError, match="'ppo' is already registered"):
        register_policy_loss("ppo")
    assert "bad" not in ADVANTAGE_ESTIMATORS


def test_a_policy_loss_gets_exactly_the_inputs_it_declares(registered):
    assert load_config(PolicyTrainConfig, None, ["algorithm.policy_loss=ppo"]).algorithm.policy_loss_inputs() == {}
    cfg = load_config(PolicyTrainConfig, None, ["algorithm.policy_loss=cpgd", "algorithm.policy_drift_coef=0.3"])
    assert cfg.algorithm.policy_loss_inputs() == {"policy_drift_coef": 0.3}

    seen = {}

    def toy_loss(log_probs, old_log_probs, advantages, mask, *, entropy_coef, **_):
        seen["entropy_coef"] = entropy_coef
        return -advantages * log_probs, log_probs - old_log_probs.detach(), {}

    register_policy_loss("toy", extra_inputs=("entropy_coef",))(toy_loss)
    registered(POLICY_LOSSES, "toy")
    cfg = load_config(PolicyTrainConfig, None, ["algorithm.policy_loss=toy", "algorithm.entropy_coef=0.25"])
    x = torch.zeros(1, 2, requires_grad=True)
    compute_policy_loss("toy", x, x.detach(), torch.ones(1, 2), torch.ones(1, 2), **cfg.algorithm.policy_loss_inputs())
    assert seen == {"entropy_coef": 0.25}

    register_policy_loss("toy_unknown", extra_inputs=("toy_coef",))(toy_loss)
    registered(POLICY_LOSSES, "toy_unknown")
    assert _refused(["algorithm.policy_loss=toy_unknown"]) == (
        "algorithm.policy_loss=toy_unknown takes toy_coef, which is no algorithm.* option; add the option to "
        "AlgorithmConfig"
    )
