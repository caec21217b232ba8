"""Typed config of ``vlrft train-policy`` (YAML file + ``key.sub=value`` overrides).

Knob names follow the peers (OpenRLHF / verl / TRL): ``rollout.rollout_batch_size``,
``rollout.n_samples_per_prompt``, ``train.train_batch_size``, ``train.micro_train_batch_size``,
``train.max_epochs``, ``train.num_episodes``, ``algorithm.advantage_estimator``, ``algorithm.kl_coef`` ...
Every field's help text is printed by ``vlrft train-policy --help``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from reward_models.pool import RewardPoolConfig
from reward_models.sources import VerifierSourceConfig
from vlrft.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    STD_NORMALIZATIONS,
    AdvantageEstimator,
)
from vlrft.algorithms.rollout_correction import OFF_POLICY_CORRECTIONS, ROLLOUT_CORRECTIONS
from vlrft.config import ConfigError, option
from vlrft.micro_batching import micro_batch_tokens_option
from vlrft.models.loading import ModelConfig
from vlrft.rollout.config import RolloutConfig
from vlrft.run_config import DataSourceConfig, RunConfig
from vlrft.strategies.config import OptimConfig, StrategyConfig
from vlrft.tools import ToolsConfig
from vlrft.tracking import LoggingConfig
from vlrft.trainer.teacher import TeacherConfig

# The embedded default: one rule verifier that reads the answer word of a synthetic task's response.
DEFAULT_REWARD = RewardPoolConfig(sources=[VerifierSourceConfig(name="accuracy", verifier="vocab_answer")])


PolicyModelConfig = ModelConfig  # the policy's model section (vlrft.models.loading)


@dataclass
class PolicyDataConfig(DataSourceConfig):
    """Prompt records for training and held-out evaluation (``vlrft.loop.DataSourceConfig``), and how they
    are read and formatted."""

    record_kind: str = option(
        "prompt",
        "prompt: prompt records; judgment: judgment records whose verdict (the target's last <answer> tag) is "
        "the reference answer (judge RL: verifiers judge_verdict + judge_format; synthetic:TASK draws judgments)",
        choices=("prompt", "judgment"),
    )
    judge_mode: str = option(
        "pairwise",
        "judgment format of synthetic judgment records (record_kind judgment)",
        choices=("pointwise", "pairwise"),
    )
    group_size: int = option(
        1,
        "keep groups of this many consecutive training records in one rollout batch (judge RL: 2 = a pair in "
        "both orders, so the image's own effect cancels); rollout_batch_size must be a multiple",
        ge=1,
    )
    prompt_template: str = option(
        "plain", "name in PROMPT_TEMPLATES (plain, math_boxed, gsm8k, ...) or a format string with {prompt}"
    )
    max_prompt_length: int = option(2048, "longer prompts (image tokens included) are filtered, counted", ge=1)
    column_map: dict = option({}, "source column -> record field, e.g. {problem: prompt}")


@dataclass
class AlgorithmConfig:
    """Advantages, policy loss, KL and reward shaping (see docs/algorithms.md)."""

    advantage_estimator: str = option("grpo", "advantage estimator", choices=ADVANTAGE_ESTIMATORS)
    std_normalization: str = option(
        "",
        "divide the centred rewards by the std over the group, the batch, or none (Dr.GRPO); which ones an "
        "estimator accepts: docs/algorithms.md; empty: the estimator's default",
        choices=("", *STD_NORMALIZATIONS),
    )
    policy_loss: str = option("ppo", "policy loss", choices=POLICY_LOSSES)
    clip_low: float = option(0.2, "lower clip range: ratio >= 1 - clip_low", ge=0, le=1)
    clip_high: float = option(0.2, "upper clip range: ratio <= 1 + clip_high (DAPO clip-higher: 0.28)", ge=0)
    dual_clip: float = option(0.0, "dual-clip constant c > 1 for negative advantages (0: off; ppo only)", ge=0)
    loss_agg_mode: str = option("token-mean", "how per-token losses become one loss", choices=LOSS_AGG_MODES)
    kl_coef: float = option(0.0, "KL weight (0: no reference model is loaded)", ge=0)
    kl_estimator: str = option("k3", "KL estimator", choices=KL_ESTIMATORS)
    kl_max: float = option(
        0.0, "bound on k3 per token, no gradient above it (verl's and OpenRLHF's: 10; 0: unbounded)", ge=0
    )
    use_kl_loss: bool = option(True, "KL as a loss term (GRPO); false: as a per-token reward penalty (PPO)")
    kl_target: float = option(0.0, "adaptive KL controller target (0: fixed kl_coef)", ge=0)
    kl_horizon: int = option(10000, "adaptive KL controller horizon", ge=1)
    entropy_coef: float = option(0.0, "entropy bonus weight", finite=True)
    gamma: float = option(1.0, "discount (gae, reinforce_plus_plus)", ge=0, le=1)
    lam: float = option(1.0, "GAE lambda", ge=0, le=1)
    value_clip: float = option(
        0.2, "value-loss clip range around the rollout-time values (ppo with critic; 0: off)", ge=0
    )
    value_coef: float = option(0.5, "value-loss weight (ppo with critic)", ge=0)
    dynamic_sampling: bool = option(False, "DAPO: drop zero-variance groups and draw more prompts")
    max_sampling_tries: int = option(4, "DAPO: generation rounds per step before training on what is kept", ge=1)
    overlong_buffer_len: int = option(0, "DAPO soft overlong punishment buffer (0: off)", ge=0)
    overlong_penalty_factor: float = option(1.0, "DAPO overlong penalty at the length limit", ge=0)
    reward_clip: float = option(0.0, "clip rewards to [-c, c] (0: off)", ge=0)
    normalize_rewards: bool = option(False, "running mean/std reward normalisation")
    high_entropy_rho: float = option(
        1.0, "train only on the top rho fraction of tokens by entropy (1: all)", gt=0, le=1
    )
    policy_drift_coef: float = option(0.1, "CPGD policy-drift weight", ge=0)
    sapo_tau_pos: float = option(
        1.0,
        "SAPO gate temperature for positive advantages (larger: the gate closes sooner as the ratio leaves 1)",
        gt=0,
    )
    sapo_tau_neg: float = option(
        1.05, "SAPO gate temperature for negative advantages (the paper: > sapo_tau_pos)", gt=0
    )
    rollout_correction: str = option(
        "none",
        "correction for the rollout engine's log-probs differing from the trainer's (rollout.engine=vllm, or any "
        "engine with rollout.first_token_temperature: FIRE's hot first token): "
        "none, token_tis (truncated IS per token), sequence_mask (drop sequences off by more than the threshold)",
        choices=ROLLOUT_CORRECTIONS,
    )
    rollout_is_cap: float = option(2.0, "token_tis: cap C of the per-token weight min(pi_old / pi_rollout, C)", gt=0)
    rollout_mask_threshold: float = option(
        2.0, "sequence_mask: keep a sequence if its geometric-mean ratio lies in [1/threshold, threshold]"
    )
    off_policy: str = option(
        "none",
        "off-policy correction for asynchronous RL (rollout.mode=async: tokens sampled by older policy versions): "
        "none, or decoupled (AReaL's decoupled PPO, Fu et al. 2025, arXiv 2505.24298: the per-token loss weighted by "
        "pi_prox / pi_behav, clipped around the proximal policy pi_prox = the trainer's old log-probs); needs the "
        "engine's log-probs of the sampled tokens (pi_behav; the trainer asks the engine for them); replaces "
        "rollout_correction (docs/algorithms.md)",
        choices=OFF_POLICY_CORRECTIONS,
    )
    behav_imp_weight_cap: Optional[float] = option(
        None,
        "off_policy decoupled: leave out of the loss each token whose pi_prox / pi_behav exceeds this cap (AReaL's "
        "behav_imp_weight_cap; AReaL recommends 5); the token still counts in the loss's denominator; null: no cap",
        gt=1,
    )
    router_aux_coef: Optional[float] = option(
        None,
        "weight of a mixture-of-experts policy's router load-balancing loss (Switch Transformer's, over the response "
        "tokens) in the update; null: the model config's router_aux_loss_coef (0 for a dense model); > 0 on a dense "
        "model is an error; > 0 makes the update's forward take the plain path, not the group-shared one",
        ge=0,
    )

    @property
    def estimator(self) -> AdvantageEstimator:
        """The registry entry of ``advantage_estimator``: whether it needs groups, a critic, which stds."""
        return ADVANTAGE_ESTIMATORS[self.advantage_estimator]

    def policy_loss_inputs(self) -> dict[str, object]:
        """The ``algorithm.*`` options that ``policy_loss`` declares as its own inputs (``extra_inputs``), by
        name: the keyword arguments the trainer adds to ``compute_policy_loss``."""
        return {name: getattr(self, name) for name in POLICY_LOSSES[self.policy_loss].extra_inputs}

    def validate(self) -> None:
        spec = self.estimator
        if self.std_normalization and self.std_normalization not in spec.std_normalizations:
            raise ConfigError(
                f"algorithm.std_normalization={self.std_normalization}: does not apply to "
                f"algorithm.advantage_estimator={self.advantage_estimator} (accepted: "
                f"{', '.join(spec.std_normalizations)}; empty picks its default {spec.default_std})"
            )
        known = {f.name for f in fields(self)}
        missing = [n for n in POLICY_LOSSES[self.policy_loss].extra_inputs if n not in known]
        if missing:
            raise ConfigError(
                f"algorithm.policy_loss={self.policy_loss} takes {', '.join(missing)}, which is no algorithm.* "
                "option; add the option to AlgorithmConfig"
            )
        self._check_sapo()
        self._check_off_policy()
        if self.kl_max > 0 and self.kl_estimator != "k3":
            raise ConfigError(
                f"algorithm.kl_max={self.kl_max}: bounds the k3 estimator only, not "
                f"algorithm.kl_estimator={self.kl_estimator}; leave it 0"
            )

    def _check_sapo(self) -> None:
        """SAPO has a gate and no clip range; its temperatures are read by it alone: neither is set in vain."""
        defaults = {f.name: f.default for f in fields(self)}
        keys, why = ("sapo_tau_pos", "sapo_tau_neg"), f"read by policy_loss sapo only, not {self.policy_loss}"
        if self.policy_loss == "sapo":
            keys, why = ("clip_low", "clip_high"), "sapo has no clip range (its gate: algorithm.sapo_tau_pos / _neg)"
        for key in keys:
            if getattr(self, key) != defaults[key]:
                raise ConfigError(f"algorithm.{key}={getattr(self, key)}: {why}; leave it unset")

    def _check_off_policy(self) -> None:
        """Decoupled PPO's weight pi_prox / pi_behav is itself the correction for the engine's log-probs, so it does
        not stack with rollout correction; its cap is read by it alone."""
        if self.behav_imp_weight_cap is not None and self.off_policy != "decoupled":
            raise ConfigError(
                f"algorithm.behav_imp_weight_cap={self.behav_imp_weight_cap}: read by off_policy decoupled only, "
                f"not {self.off_policy}; leave it unset"
            )
        if self.off_policy == "decoupled" and self.rollout_correction != "none":
            raise ConfigError(
                f"algorithm.rollout_correction={self.rollout_correction}: not with algorithm.off_policy=decoupled, "
                "which already weights each token by pi_prox / pi_behav (what rollout correction does); set it to none"
            )


@dataclass
class CriticConfig:
    """The value model of PPO with GAE (used only when algorithm.advantage_estimator needs a critic: gae)."""

    path: str = option(
        "",
        "an SRM folder (vlrft train-reward-model: the critic starts from the reward model, as "
        "in InstructGPT/OpenRLHF) or a Qwen(-VL) checkpoint (a fresh value head); empty: the policy's",
        reads=True,
    )
    lr: float = option(5e-6, "critic learning rate (the rest of optim.* is shared with the policy)", gt=0)


@dataclass
class PolicyTrainLoopConfig(RunConfig):
    """The run (``vlrft.loop.RunConfig``) and the policy update's batches."""

    train_batch_size: int = option(
        0, "samples per optimizer step, global (0: the whole rollout batch: one on-policy update)", ge=0
    )
    micro_train_batch_size: int = option(32, "samples per forward/backward per rank", ge=1)
    micro_batch_tokens: int = micro_batch_tokens_option()
    shared_prompt_forward: bool = option(
        True, "each prompt (text, images, vision tower) computed once per group in every training-side forward"
    )
    max_epochs: int = option(1, "passes over each rollout batch (PPO epochs)", ge=1)
    eval_temperature: float = option(0.0, "held-out evaluation temperature (0: greedy)", ge=0)
    eval_n: int = option(1, "responses per held-out prompt (pass@k for k <= eval_n)", ge=1)
    collapse_share: float = option(
        0.8, "answer-collapse alarm: one answer for more than this share of distinct prompts", gt=0, le=1
    )
    collapse_steps: int = option(
        5, "answer-collapse alarm: ... with no group of mixed outcomes, for this many steps in a row", ge=1
    )
    collapse_evals: int = option(
        4,
        "answer-collapse alarm, the other signature: the held-out greedy answers collapsed the same way at this many "
        "evaluations in a row without the held-out accuracy rising",
        ge=2,
    )
    on_collapse: str = option(
        "warn",
        "a sustained answer collapse (the alarm): warn; stop (exit code 2); or rollback to the newest checkpoint "
        "from before it with the learning rate times collapse_lr_factor",
        choices=("warn", "stop", "rollback"),
    )
    collapse_lr_factor: float = option(0.5, "on_collapse=rollback: the learning rate is multiplied by this", gt=0, le=1)
    max_rollbacks: int = option(2, "on_collapse=rollback: at most this many rollbacks, then the run stops", ge=1)
    log_samples: int = option(4, "trajectories written to samples.jsonl per step", ge=0)
    probe_every: int = option(
        0,
        "reward canary: every N steps, the probes of vlrft probe-rewards on probe_records training records through "
        "the run's pool (probe/* metrics, a console line when one is flagged); 0: off",
        ge=0,
    )
    probe_records: int = option(4, "reward canary: training records probed each time", ge=1)


@dataclass
class PolicyTrainConfig:
    """``vlrft train-policy``: RL fine-tuning of a Qwen-VL (or text Qwen) policy."""

    model: PolicyModelConfig = option(PolicyModelConfig(), "the policy")
    data: PolicyDataConfig = option(PolicyDataConfig(), "prompt records")
    rollout: RolloutConfig = option(RolloutConfig(), "sampling")
    algorithm: AlgorithmConfig = option(AlgorithmConfig(), "RL algorithm")
    reward: RewardPoolConfig = option(DEFAULT_REWARD, "reward pool: weighted sources, per-task recipes")
    critic: CriticConfig = option(CriticConfig(), "value model (PPO with GAE)")
    teacher: TeacherConfig = option(TeacherConfig(), "on-policy distillation's teacher (docs/distillation.md)")
    tools: ToolsConfig = option(ToolsConfig(), "multi-turn rollouts with tools (docs/tools.md); none by default")
    optim: OptimConfig = option(OptimConfig(lr=1e-6), "AdamW and learning-rate schedule")
    strategy: StrategyConfig = option(StrategyConfig(), "single process, FSDP2 or DeepSpeed")
    train: PolicyTrainLoopConfig = option(
        PolicyTrainLoopConfig(output_dir="runs/train-policy", eval_every=20), "the run, update batches, evaluation"
    )
    logging: LoggingConfig = option(LoggingConfig(wandb_project="vlrft-policy"), "TensorBoard, wandb, progress bar")

    def sequence_length(self) -> int:
        """The longest prompt and response a sample can have (a trajectory's budget with tools)."""
        response = self.tools.max_tokens if self.tools.enabled else self.rollout.max_new_tokens
        return self.data.max_prompt_length + response

    def _check_async(self) -> None:
        """What ``rollout.mode=async`` cannot do (yet), each refused in one line."""
        r = self.rollout
        if r.mode != "async":
            return
        if self.algorithm.dynamic_sampling:
            raise ConfigError(
                "algorithm.dynamic_sampling=true: not with rollout.mode=async (the rollout ranks sample each step's "
                "prompts once; redrawing would need the trainers' verdict first); use rollout.mode=colocated"
            )
        if r.keyed_sampling is False:
            raise ConfigError(
                "rollout.keyed_sampling=false: rollout.mode=async samples with keyed sampling (the tokens must not "
                "depend on which rank samples a prompt); leave it unset"
            )
        if self.train.on_collapse == "rollback":
            raise ConfigError(
                "train.on_collapse=rollback: not with rollout.mode=async (the rollout ranks have sampled past the "
                "checkpoint); use stop or warn"
            )
        if r.asynchronous.partial and r.engine != "hf":
            raise ConfigError(
                f"rollout.asynchronous.partial=true: loads weights between the decode steps of the hf engine only, "
                f"not rollout.engine={r.engine}; use rollout.engine=hf or partial=false"
            )
        if r.asynchronous.partial and self.tools.enabled:
            raise ConfigError(
                "rollout.asynchronous.partial=true: not with tools (a multi-turn trajectory does not carry its tokens' "
                "versions yet); use partial=false"
            )

    def validate(self) -> None:
        r, t = self.rollout, self.train
        if self.algorithm.estimator.teacher and not self.teacher.enabled:
            raise ConfigError(
                f"algorithm.advantage_estimator={self.algorithm.advantage_estimator}: needs a teacher "
                "(teacher.path: a model folder with the policy's tokenizer, or teacher.url: a server of one)"
            )
        self.teacher.check()
        if r.engine == "vllm":  # vLLM's SamplingParams refuse a temperature above 2 at the first request
            temperatures = [("rollout.temperature", r.temperature), ("train.eval_temperature", t.eval_temperature)]
            temperatures.append(("rollout.first_token_temperature", r.first_token_temperature))
            for key, value in temperatures:
                if value is not None and value > 2:
                    raise ConfigError(
                        f"{key}={value:g}: rollout.engine=vllm samples at temperatures in [0, 2]; use 2 or less, or "
                        "rollout.engine=hf"
                    )
        if self.algorithm.estimator.group and r.n_samples_per_prompt < 2:
            raise ConfigError(
                f"rollout.n_samples_per_prompt={r.n_samples_per_prompt}: must be >= 2 for "
                f"algorithm.advantage_estimator={self.algorithm.advantage_estimator} (a group baseline needs two "
                "samples per prompt); use reinforce_plus_plus for one sample per prompt"
            )
        total = r.rollout_batch_size * r.n_samples_per_prompt
        if t.train_batch_size and total % t.train_batch_size:
            raise ValueError(
                f"train.train_batch_size={t.train_batch_size} must divide rollout_batch_size x "
                f"n_samples_per_prompt = {total}"
            )
        if not 0 <= self.algorithm.overlong_buffer_len <= r.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer_len={self.algorithm.overlong_buffer_len} must lie in "
                f"0..rollout.max_new_tokens ({r.max_new_tokens})"
            )
        if self.data.group_size < 1 or r.rollout_batch_size % self.data.group_size:
            raise ValueError(
                f"rollout.rollout_batch_size={r.rollout_batch_size} must be a multiple of data.group_size="
                f"{self.data.group_size} (>= 1), so that a group never straddles two rollout batches"
            )
        if self.algorithm.max_sampling_tries < 1:
            raise ValueError(f"algorithm.max_sampling_tries must be >= 1, got {self.algorithm.max_sampling_tries}")
        if t.on_collapse == "rollback" and self.strategy.name == "deepspeed":
            raise ValueError(
                "train.on_collapse=rollback: not with strategy.name=deepspeed (its optimizer's learning rate cannot "
                "be lowered mid-run); use fsdp2 or single, or train.on_collapse=stop"
            )
        if self.algorithm.rollout_is_cap <= 0 or self.algorithm.rollout_mask_threshold <= 1:
            raise ValueError(
                f"algorithm.rollout_is_cap must be > 0 (got {self.algorithm.rollout_is_cap}) and "
                f"algorithm.rollout_mask_threshold > 1 (got {self.algorithm.rollout_mask_threshold})"
            )
        self._check_async()
        if r.routing_replay and r.engine != "hf":
            raise ConfigError(
                f"rollout.routing_replay=true: the hf engine records the experts its MoE layers chose; "
                f"rollout.engine={r.engine} does not return them; use rollout.engine=hf or routing_replay=false"
            )
        if r.routing_replay and self.tools.enabled:
            raise ConfigError(
                "rollout.routing_replay=true: not with tools (a multi-turn trajectory's later turns are generated by "
                "calls whose experts are not joined into the trajectory yet); use routing_replay=false"
            )
        if self.algorithm.dual_clip and self.algorithm.dual_clip <= 1:
            raise ValueError(f"algorithm.dual_clip must be > 1 (or 0 for off), got {self.algorithm.dual_clip}")
