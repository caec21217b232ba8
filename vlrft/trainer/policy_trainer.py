"""The policy trainer: one RL step, readable top to bottom (``PolicyTrainer.step``, whose docstring lists which
file does what, in order), a plug-in of the one run driver (``vlrft.loop.Run.fit``: resume, held-out evaluation,
checkpoints, metrics and export around the steps).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from data_pipelines.collate import collate_sequences, tokenizer_of
from data_pipelines.records import PromptRecord
from vlrft.algorithms import (
    AdaptiveKLController,
    DynamicSamplingExhausted,
    FixedKLController,
    RunningRewardNormalizer,
    apply_kl_penalty,
    clip_rewards,
    distillation_rewards,
    global_sequence_count,
    global_token_count,
    kl_penalty,
    more_prompts_needed,
    overlong_penalty,
)
from vlrft.config import ConfigError
from vlrft.loop import Trainer
from vlrft.micro_batching import sequence_micro_batches
from vlrft.models.moe import arch_name, is_moe, router_aux_coef
from vlrft.models.routing_replay import collate_routing, replaying
from vlrft.nonfinite import NonFiniteGuard
from vlrft.rollout import SamplingParams, make_engine, stack_rollout_logprobs
from vlrft.rollout.base import sampling_key, vision_token_ids
from vlrft.rollout.trajectories import TrajectoryRunner
from vlrft.sampling import PromptStream
from vlrft.strategies import Strategy
from vlrft.strategies.numerics import mean_over_ranks
from vlrft.strategies.placement import Placement
from vlrft.tools import ToolBox
from vlrft.tracking import append_jsonl
from vlrft.trainer.async_rl import AsyncRollouts
from vlrft.trainer.canary import RewardCanary
from vlrft.trainer.collapse import CollapseMonitor
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.experience import (
    Experience,
    ScoredGroup,
    advantage_metrics,
    draw_groups,
    global_advantages,
    infer_response_logprobs,
    infer_response_values,
    response_tensors,
    rollout_metrics,
)
from vlrft.trainer.heldout import HeldoutContext
from vlrft.trainer.micro_losses import critic_micro_loss, policy_micro_loss, update_shares_prompts
from vlrft.trainer.teacher import Teachers, distillation_metrics


class PolicyTrainer(Trainer):
    progress_metric = ("reward", "reward/combined")
    curve_keys = ("reward/combined", "accuracy", "frac_reward_zero_std", "async/staleness_mean")
    # the console line of a step (everything goes to metrics.jsonl, TensorBoard and wandb)
    console_keys = ("reward/", "accuracy", "frac_reward_zero_std", "entropy", "kl", "response_length/mean")
    console_keys += ("train/grad_norm", "critic/loss", "time/step", "eval/accuracy", "eval/pass@", "distill/reverse_kl")
    console_keys += ("async/staleness_mean",)

    def __init__(
        self,
        cfg: PolicyTrainConfig,
        strategy: Strategy,
        model: torch.nn.Module,
        processor: Any,
        train_records: list[PromptRecord],
        reward_pool: Any,
        *,
        eval_records: list[PromptRecord] | None = None,
        ref_model: torch.nn.Module | None = None,
        teacher: Teachers | None = None,
        evaluate_fn: Any = None,
        accuracy: tuple[str, str] | None = None,
        critic: tuple[torch.nn.Module, Strategy] | None = None,
        total_steps: int | None = None,
        guard: NonFiniteGuard | None = None,
        log: Callable[[str], None] = print,
        tools: ToolBox | None = None,
        placement: Placement | None = None,
        model_path: str = "",
    ):
        """``accuracy``: (reward source, its verifier) whose score > 0.5 counts as a correct response.
        ``critic``: (value model, its own strategy) for PPO with GAE; its optimizer is built here.
        ``total_steps`` (the run's, ``vlrft.loop.Run.total_steps``; default ``train.max_steps``) sets the
        learning-rate schedule; ``guard`` is the run's non-finite guard; ``log`` prints a console line; ``tools``: the
        run's tools (multi-turn rollouts, ``vlrft.rollout.trajectories``); ``teacher``: on-policy distillation's
        (``vlrft.trainer.teacher``); ``placement``: ``rollout.mode=async``'s (``vlrft.strategies.placement``): the
        rollout ranks sample and score (``vlrft.trainer.async_rl``), this rank trains; ``model_path``: the folder the
        policy was loaded from (what the rollout ranks load)."""
        self.cfg, self.strategy, self.processor = cfg, strategy, processor
        self.tokenizer = tokenizer_of(processor)
        self.pad_id = self.tokenizer.pad_token_id
        self.train_records, self.eval_records = train_records, eval_records or []
        self.reward_pool, self.ref_model, self.teacher, self.log = reward_pool, ref_model, teacher, log
        self.evaluate_fn = evaluate_fn
        self.accuracy_source, self.accuracy_verifier = accuracy or (None, None)
        t = cfg.train
        self.collapse = CollapseMonitor.for_run(self.accuracy_verifier, t, strategy, log)
        self.canary = RewardCanary(reward_pool, train_records, t.probe_every, t.probe_records, t.seed, log)
        r = cfg.rollout
        if r.rollout_batch_size % strategy.world_size:
            raise ValueError(
                f"rollout.rollout_batch_size={r.rollout_batch_size} must be a multiple of the "
                f"number of processes ({strategy.world_size})"
            )
        self.total_steps = total_steps or cfg.train.max_steps
        router_aux_coef(model, cfg.algorithm.router_aux_coef)  # a router loss asked of a dense model: one line, now
        if r.routing_replay and not is_moe(model):
            raise ConfigError(
                f"rollout.routing_replay=true: {arch_name(model)} is a dense model (no experts to replay); "
                "use routing_replay=false"
            )
        self.model, self.optimizer, self.scheduler = strategy.prepare(
            model, total_steps=self.total_steps * self._updates_per_step()
        )
        self.train_module = strategy.train_module
        self.critic = self.critic_strategy = None
        if critic is not None:
            self.critic_strategy = critic[1]
            self.critic = critic[1].prepare(critic[0], total_steps=self.total_steps * self._updates_per_step())[0]
            self.critic_module = critic[1].train_module
        self.engine = make_engine(
            r,
            strategy.unwrap(),
            processor,
            synced=strategy.shards_parameters,
            distributed=strategy.distributed,
            device=strategy.device,
        )
        self.tools = tools
        self.trajectories = TrajectoryRunner(self.engine, processor, tools, cfg.tools) if tools is not None else None
        a = cfg.algorithm
        adaptive = AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon) if a.kl_target > 0 else None
        self.kl_ctl = adaptive or FixedKLController(a.kl_coef)
        self.normalizer = RunningRewardNormalizer() if a.normalize_rewards else None
        self.guard = guard or NonFiniteGuard(cfg.train.max_nonfinite_steps)
        self.steps_done = 0  # steps done (the index of the one running, while it runs)
        self.prompts = PromptStream(train_records, cfg.data.group_size, cfg.train.seed)  # its cursor: the position
        self._step_prompt_ids: list[str] = []
        self.out = Path(cfg.train.output_dir)
        # the vision placeholders no engine samples: log-probs are those of the sampling distribution
        self.suppress = torch.tensor(vision_token_ids(self.tokenizer), dtype=torch.long)
        self.shared = cfg.train.shared_prompt_forward  # each prompt once per group (models/packing.py)
        # keyed sampling: the tokens of a prompt do not depend on the rank or the call that samples it
        self.keyed = r.keyed_sampling if r.keyed_sampling is not None else r.mode == "async"
        self.async_rollouts = AsyncRollouts(placement, cfg, strategy) if placement is not None else None
        self.model_path = model_path

    # ----------------------------------------------------------------------------- data order
    def _updates_per_step(self) -> int:
        total = self.cfg.rollout.rollout_batch_size * self.cfg.rollout.n_samples_per_prompt
        per_epoch = total // (self.cfg.train.train_batch_size or total)
        return per_epoch * self.cfg.train.max_epochs

    def _next_prompts(self, count: int) -> list[PromptRecord]:
        """The next ``count`` prompts of the global stream; returns this rank's share."""
        picked = self.prompts.take(count)
        self._step_prompt_ids += [r.id for r in picked]
        s = self.strategy
        return picked[s.rank :: s.world_size]

    # ----------------------------------------------------------------------------- experience
    def _draw(self, per_rank: int, sampling: SamplingParams, metrics: dict[str, float]) -> list[ScoredGroup]:
        """The next ``per_rank`` prompts of this rank, encoded once, sampled by the engine and scored."""
        records = self._next_prompts(per_rank * self.strategy.world_size)
        keys = [sampling_key(self.cfg.train.seed, self.steps_done, r.id) for r in records] if self.keyed else None
        return draw_groups(
            self.engine, self.processor, records, sampling, self.cfg, self.reward_pool, self.trajectories, metrics, keys
        )

    def make_experience(self, metrics: dict[str, float]) -> Experience:
        """One rollout batch of this rank: ``rollout_batch_size / world_size`` scored groups. With DAPO's
        dynamic sampling, groups whose rewards all agree are dropped and more prompts drawn (every rank
        draws as many as the shortest-filled one needs, so sharded engines generate in step) until the
        batch is full or ``max_sampling_tries`` rounds ran; then it trains on what was kept, or, if a
        rank kept nothing, on its last round unfiltered (zero advantages: the schedule stays in step)."""
        a, r, s = self.cfg.algorithm, self.cfg.rollout, self.strategy
        per_rank = r.rollout_batch_size // s.world_size
        if self.async_rollouts is not None:  # the rollout ranks sampled and scored this step's groups
            records = self._next_prompts(per_rank * s.world_size)
            t0 = time.perf_counter()
            groups = self.async_rollouts.receive(self.steps_done, records, metrics)
            metrics["time/rollout"] = time.perf_counter() - t0
            return self.experience_from(groups, metrics)
        sampling = self.sampling()
        groups: list[ScoredGroup] = []
        t0, tries, need = time.perf_counter(), 0, per_rank
        metrics["time/reward"] = 0.0
        while need:
            tries += 1
            last_draw = self._draw(need, sampling, metrics)
            drawn = [g for g in last_draw if g.varied()] if a.dynamic_sampling else last_draw
            groups += drawn[: per_rank - len(groups)]
            if not a.dynamic_sampling:
                break
            short = int(s.all_reduce(torch.tensor(float(per_rank - len(groups))), "max"))
            try:
                need = more_prompts_needed(per_rank - short, per_rank, tries, a.max_sampling_tries)
            except DynamicSamplingExhausted as exc:
                self.log(f"step {self.steps_done + 1}: {exc}; training on the groups kept")
                need = 0
        exhausted = a.dynamic_sampling and bool(s.all_reduce(torch.tensor(float(not groups)), "max"))
        if exhausted:
            groups = last_draw
        metrics["dynamic_sampling/exhausted"] = float(exhausted)
        metrics["dynamic_sampling/tries"] = float(tries)
        metrics["time/rollout"] = time.perf_counter() - t0 - metrics["time/reward"]
        return self.experience_from(groups, metrics)

    def sampling(self) -> SamplingParams:
        """How the policy samples its groups; the engine reports the drawn tokens' log-probs where the decoupled
        objective weighs by them (``algorithm.off_policy``)."""
        sampling = self.cfg.rollout.sampling()
        # with routing replay too: rollout/logprob_diff_* then show the engine-vs-trainer gap that replay closes
        asks = self.cfg.algorithm.off_policy == "decoupled" or self.cfg.rollout.routing_replay
        return replace(sampling, logprobs=True) if asks else sampling

    def experience_from(self, groups: list[ScoredGroup], metrics: dict[str, float]) -> Experience:
        """Log-probs, shaping and advantages for this rank's scored groups (a group's position is its id)."""
        a, r = self.cfg.algorithm, self.cfg.rollout
        rollouts = [x for g in groups for x in g.rollouts]
        group_ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.rollouts])
        rewards_t = torch.cat([g.rewards for g in groups])
        per_source_t = {k: torch.cat([g.per_source[k] for g in groups]) for k in groups[0].per_source}
        responses = [x.trajectory.response if x.trajectory is not None else x.response_ids for x in rollouts]
        batch = collate_sequences([g.prompt for g in groups], group_ids.tolist(), responses, self.pad_id)
        if self.cfg.rollout.routing_replay:  # the experts the rollout chose, replayed by every forward of the policy
            batch["routing"] = collate_routing([x.routing for x in rollouts], batch["input_ids"].shape[1])
        actions = [x.trajectory.action_mask if x.trajectory is not None else None for x in rollouts]
        response_ids, response_mask = response_tensors([x.response_ids for x in rollouts], self.pad_id, actions)

        t0 = time.perf_counter()
        # one update per step: the old (proximal) log-probs are the current policy's own, detached in the update's
        # forward, also for groups an older version sampled (rollout.mode=async: the policy before this update is the
        # proximal one; the decoupled objective weighs by it against the engine's behaviour log-probs)
        on_policy_single_pass = self._updates_per_step() == 1
        old_logp = None if on_policy_single_pass else self._logprobs(self.model, batch, response_ids)
        metrics["time/old_logprobs"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref_logp = self._logprobs(self.ref_model, batch, response_ids) if self.ref_model is not None else None
        metrics["time/ref_logprobs"] = time.perf_counter() - t0

        # reward shaping -> advantages (over the global batch: every rank computes them identically)
        shaped = rewards_t.clone()
        if a.overlong_buffer_len > 0:
            shaped = shaped + overlong_penalty(
                batch["response_lengths"].float(), r.max_new_tokens, a.overlong_buffer_len, a.overlong_penalty_factor
            )
        if a.reward_clip > 0:
            shaped = clip_rewards(shaped, -a.reward_clip, a.reward_clip)
        if self.normalizer is not None:
            shaped = self.normalizer.normalize(shaped)
        distill = teacher_logp = None
        if self.teacher is not None:  # on-policy distillation: the teacher's view of every sampled token
            if old_logp is None:
                old_logp = self._logprobs(self.model, batch, response_ids)  # the student's (behaviour) log-probs
            names = [str(g.record.metadata.get("teacher", "")) for g in groups for _ in g.rollouts]
            kwargs = {"shared": self.shared, "suppress": self.suppress}
            teacher_logp = self.teacher.log_probs(batch, response_ids, names, **kwargs)
            if self.teacher.failed:  # a served teacher's counted fallback: no distillation term for those samples
                teacher_logp[self.teacher.failed] = old_logp[self.teacher.failed]
            metrics["distill/teacher_failures"] = float(len(self.teacher.failed))
            distill = self.cfg.teacher.coef * distillation_rewards(teacher_logp, old_logp, response_mask)
            if self.cfg.teacher.per_token == "vocabulary":  # the update's exact reverse KL carries it, not a reward
                distill = torch.zeros_like(distill)
            metrics.update(distillation_metrics(teacher_logp, old_logp, response_mask, self.teacher.take_seconds()))
        if a.estimator.teacher:  # the distillation rewards are the token rewards (no outcome reward)
            shaped = torch.zeros_like(shaped)
        token_rewards = shaped
        if ref_logp is not None and not a.use_kl_loss and self.kl_ctl.value > 0:
            old = old_logp if old_logp is not None else self._logprobs(self.model, batch, response_ids)
            kl = kl_penalty(old, ref_logp, a.kl_estimator, a.kl_max)
            token_rewards = apply_kl_penalty(shaped, kl, response_mask, self.kl_ctl.value)
        if a.estimator.teacher:
            token_rewards = distill + (token_rewards if token_rewards.dim() == 2 else 0.0)
        values = None
        if self.critic is not None:
            mbs = self.cfg.train.micro_train_batch_size
            values = infer_response_values(self.critic, batch, response_ids, micro_batch_size=mbs, shared=self.shared)
        advantages, returns = global_advantages(self.strategy, a, token_rewards, response_mask, group_ids, values)
        if distill is not None and not a.estimator.teacher:  # verl's and Qwen3's recipe: task advantage + coef x term
            advantages = advantages + distill

        metrics.update(rollout_metrics(rewards_t, per_source_t, self.accuracy_source, group_ids, rollouts))
        if self.accuracy_source in per_source_t:
            correct = per_source_t[self.accuracy_source] > 0.5
            metrics.update(self.collapse.step(self.steps_done + 1, groups, correct, group_ids))
        metrics.update(advantage_metrics(advantages, response_mask))
        return Experience(
            batch=batch,
            response_ids=response_ids,
            response_mask=response_mask,
            old_log_probs=old_logp,
            ref_log_probs=ref_logp,
            rewards=rewards_t,
            advantages=advantages,
            group_ids=group_ids,
            per_source=per_source_t,
            values=values,
            returns=returns if values is not None else None,
            groups=groups,
            rollout_log_probs=stack_rollout_logprobs(rollouts, response_ids.shape[1]),
            teacher_log_probs=teacher_logp,
        )

    def _logprobs(self, model, batch, response_ids) -> torch.Tensor:
        """Response log-probs ``[N, R]`` of ``model`` (old policy or reference), without gradient."""
        mbs = self.cfg.train.micro_train_batch_size
        temperature = self._temperature()
        return infer_response_logprobs(
            model,
            batch,
            response_ids,
            micro_batch_size=mbs,
            temperature=temperature,
            shared=self.shared,
            suppress=self.suppress,
        )

    def _temperature(self) -> float:
        return self.cfg.rollout.temperature if self.cfg.rollout.temperature > 0 else 1.0

    # ----------------------------------------------------------------------------- update
    def train_on(self, exp: Experience, metrics: dict[str, float]) -> None:
        """``max_epochs`` passes of mini-batch updates over one rollout batch."""
        cfg, s = self.cfg, self.strategy
        n = len(exp)
        global_n = int(s.all_reduce(torch.tensor(float(n)), "sum"))
        # train_batch_size is global: each rank takes its share of every mini-batch (0: the whole batch)
        mini = max(1, min(n, cfg.train.train_batch_size // s.world_size)) if cfg.train.train_batch_size else n
        micro, budget = cfg.train.micro_train_batch_size, cfg.train.micro_batch_tokens
        packed = update_shares_prompts(self.train_module, exp.batch, cfg.algorithm, self.shared)
        cs = self.critic_strategy
        agg: dict[str, list[float]] = {}
        g = torch.Generator().manual_seed(cfg.train.seed * 7919 + self.steps_done)
        t0 = time.perf_counter()
        tokens = 0
        losses: list[float] = []  # the objective of each optimizer step (policy loss, KL and entropy terms)
        for _ in range(cfg.train.max_epochs):
            order = torch.randperm(n, generator=g) if self._updates_per_step() > 1 else torch.arange(n)
            for m0 in range(0, n, mini):
                # (samples, loss weight): micro_train_batch_size samples each, or up to micro_batch_tokens tokens
                # each, as many on every rank (weight 0: a padding micro-batch that keeps the ranks in step)
                parts = sequence_micro_batches(s, exp.batch, order[m0 : m0 + mini], budget, micro, packed=packed)
                micro_batches = [exp.micro_batch(idx) for idx, _ in parts]
                masks = [mb["response_mask"] for mb, (_, w) in zip(micro_batches, parts) if w]
                counts = (global_token_count(masks), global_sequence_count(masks), cfg.rollout.max_new_tokens)
                tokens += sum(int(m.sum()) for m in masks)
                losses.append(0.0)
                for k, (mb, (_, weight)) in enumerate(zip(micro_batches, parts)):
                    last = k == len(micro_batches) - 1
                    with replaying(self.train_module, mb) as replayed:  # the backward too: it may recompute
                        loss, m = self._micro_loss(mb, *counts[:2])
                        if replayed is not None:  # before the backward, which a recomputed forward would count
                            m["moe/replay_flip_share"] = replayed.flip_share
                        s.backward(loss * (s.world_size * weight), last_micro_batch=last)
                    if self.critic is not None:  # PPO's value loss, weighted by value_coef (and weight)
                        critic_loss, critic_m = critic_micro_loss(
                            self.critic_module, mb, cfg.algorithm, *counts, device=cs.device, shared=self.shared
                        )
                        cs.backward(
                            cfg.algorithm.value_coef * weight * critic_loss * cs.world_size, last_micro_batch=last
                        )
                        m.update(critic_m)
                    if not weight:  # a padding micro-batch: it only kept the ranks in step
                        continue
                    losses[-1] += float(loss.detach())
                    for key, val in m.items():
                        agg.setdefault(key, []).append(val)
                grad_norm = s.step()
                self.guard.observe(s)
                agg.setdefault("train/grad_norm", []).append(grad_norm)
                if self.critic is not None:
                    agg.setdefault("critic/grad_norm", []).append(self.critic_strategy.step())
                    self.guard.observe(self.critic_strategy)
        dt = time.perf_counter() - t0
        metrics.update({k: float(sum(v) / len(v)) for k, v in agg.items()})
        metrics["time/update"] = dt
        # each rank's share of the global objective: the mean over ranks (step's metrics) times the world size
        metrics["train/loss"] = sum(losses) / len(losses) * s.world_size
        metrics["kl_coef"] = self.kl_ctl.value
        metrics["tokens_per_s/update"] = tokens / max(dt, 1e-9)
        if isinstance(self.kl_ctl, AdaptiveKLController) and "kl" in metrics:
            self.kl_ctl.update(metrics["kl"], global_n)

    def _micro_loss(self, mb: dict[str, torch.Tensor], gtc: int, gsc: int) -> tuple[torch.Tensor, dict[str, float]]:
        """The policy loss of one micro-batch (``micro_losses.policy_micro_loss``) over the step's global counts."""
        max_len = self.cfg.rollout.max_new_tokens
        inputs = dict(temperature=self._temperature(), shared=self.shared, suppress=self.suppress)
        teacher = None
        if self.teacher is not None and self.cfg.teacher.per_token == "vocabulary":  # one in-process teacher
            one = self.teacher.teachers[""]
            score = lambda part: one.vocabulary_log_probs(part, shared=self.shared, suppress=self.suppress)  # noqa: E731
            teacher = (score, self.cfg.teacher.coef)
        a = self.cfg.algorithm
        return policy_micro_loss(
            self.train_module, mb, a, gtc, gsc, max_len, kl_coef=self.kl_ctl.value, teacher=teacher, **inputs
        )

    # ----------------------------------------------------------------------------- the driver's plug-in
    def step(self, step: int) -> dict[str, float]:
        """RL step ``step`` (0-based): rollouts, rewards, experience, the update, the engine given the weights.

        The reading path, in order (which file does what):

        1. prompts: ``vlrft/sampling.py`` (``PromptStream``: the seeded global order; this rank's share);
        2. rollouts: ``vlrft/rollout/generation.py`` (``sample_rollouts``: each prompt encoded once by
           ``data_pipelines/collate.py``) through the engine (``vlrft/rollout/hf_engine.py``, ``inference_copy.py``,
           ``vllm_engine.py``; with tools, ``trajectories.py``);
        3. rewards: ``vlrft/trainer/experience.py`` (``score_rollouts``) -> ``reward_models/pool.py`` and its
           sources; groups kept or redrawn by ``vlrft/algorithms/dynamic_sampling.py`` (``make_experience``);
        4. experience (``experience_from``): sequences collated (``data_pipelines/collate.py``), old / reference
           log-probs and values by the group-shared forward (``experience.py`` -> ``vlrft/models/packing.py``),
           reward shaping, KL and advantages over the global batch (``vlrft/algorithms/``);
        5. the update (``train_on``): micro-batches (``vlrft/micro_batching.py``), each one's loss
           (``vlrft/trainer/micro_losses.py`` -> ``vlrft/algorithms/policy_losses.py``, ``aggregation.py``,
           ``rollout_correction.py``), ``strategy.backward`` / ``step`` (``vlrft/strategies/``), the non-finite
           guard (``vlrft/nonfinite.py``);
        6. weights to the engine (``_sync_engine``): ``strategy.full_params()`` (``vlrft/strategies/weight_stream.py``)
           -> ``engine.update_weights``;
        7. logs and probes: ``data_order.jsonl`` and ``samples.jsonl`` (``_log_step``), the reward canary
           (``vlrft/trainer/canary.py``); collapse signs (``vlrft/trainer/collapse.py``) during step 4.
        """
        self.steps_done = step
        metrics: dict[str, float] = {}
        self._step_prompt_ids = []
        if self.async_rollouts is not None and not self.async_rollouts.started:
            self.async_rollouts.start(self.model_path, step, self.prompts.cursor, self.total_steps)
        started = time.perf_counter()
        with self.guard.sampling(step + 1):
            exp = self.make_experience(metrics)
        self.engine.sleep()  # the update gets the memory the engine held
        if self.guard.values_finite(self.strategy, rewards=exp.rewards, advantages=exp.advantages):
            self.train_on(exp, metrics)
        t0 = time.perf_counter()
        self._sync_engine()
        metrics["time/weight_sync"] = time.perf_counter() - t0
        self.steps_done = step + 1
        if self.async_rollouts is not None:  # version step + 1 to the rollout ranks
            metrics["time/weight_publish"] = self.async_rollouts.publish(self.steps_done)
            waited = metrics["time/rollout"] + metrics["time/weight_publish"]
            metrics["async/trainer_idle_share"] = waited / max(time.perf_counter() - started, 1e-9)
            metrics["async/trainer_samples_per_s"] = len(exp) / max(metrics.get("time/update", 0.0), 1e-9)
        self._log_step(exp)
        metrics.update(self.canary.step(self.steps_done))  # nothing unless train.probe_every says so
        return mean_over_ranks(self.strategy, metrics)  # a figure undefined on a rank's share is left out

    def evaluate(self) -> dict[str, float]:
        metrics = self.evaluate_fn(self) if self.evaluate_fn is not None else {}
        self.collapse.heldout(self.steps_done, metrics)  # the collapse detectors' held-out signature
        return metrics

    def collapse_start(self, step: int) -> int | None:
        return self.collapse.start(step)

    def heldout_context(self) -> HeldoutContext:
        """What held-out evaluation (``evaluate_fn``, e.g. ``vlrft.trainer.heldout.heldout_eval``) may use."""
        runs = {"": self.trajectories}
        if self.trajectories is not None and self.cfg.tools.eval_withheld:  # what accuracy owes to the tools' answers
            runs["withheld/"] = TrajectoryRunner(self.engine, self.processor, self.tools, self.cfg.tools, withheld=True)
        return HeldoutContext(
            self.strategy, self.processor, self.engine, self.eval_records, self.accuracy_verifier, runs, self.cfg
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps_done": self.steps_done,
            "cursor": self.prompts.cursor,
            "kl_coef": self.kl_ctl.value,
            "normalizer": self.normalizer.state_dict() if self.normalizer is not None else None,
            "reward_pool": self.reward_pool.state_dict(),
            "collapse": self.collapse.state_dict(),
            "canary": self.canary.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps_done, self.prompts.cursor, self.kl_ctl.value = state["steps_done"], state["cursor"], state["kl_coef"]
        if self.normalizer is not None and state["normalizer"] is not None:
            self.normalizer.load_state_dict(state["normalizer"])
        self.reward_pool.load_state_dict(state["reward_pool"])
        self.collapse.load_state_dict(state.get("collapse"))
        self.canary.load_state_dict(state.get("canary"))
        self._sync_engine()  # an engine with its own weights still holds the initial ones

    def close(self) -> None:
        """End what the trainer started beside itself: the rollout ranks of ``rollout.mode=async``."""
        if self.async_rollouts is not None:
            self.async_rollouts.stop()

    def extra_strategies(self) -> dict[str, Any]:
        return {"critic_checkpoints": self.critic_strategy} if self.critic is not None else {}

    def _sync_engine(self) -> None:
        """Wake the engine and hand it the updated weights (an in-process engine reads nothing)."""
        engine = self.engine
        engine.wake()
        engine.update_weights(
            self.strategy.full_params(trainable_only=not engine.needs_all_params, dtype=engine.weight_dtype)
        )

    def _log_step(self, exp: Experience) -> None:
        """Rank 0 (every rank draws the same global order): the step's prompt ids to ``data_order.jsonl`` and
        its first ``train.log_samples`` trajectories to ``samples.jsonl``."""
        if not self.strategy.is_rank0:
            return
        append_jsonl(self.out / "data_order.jsonl", {"step": self.steps_done, "prompt_ids": self._step_prompt_ids})
        for row in exp.sample_rows(self.cfg.train.log_samples):
            append_jsonl(self.out / "samples.jsonl", {"step": self.steps_done, **row})
