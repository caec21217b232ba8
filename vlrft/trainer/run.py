"""``vlrft train-policy`` end to end: build everything from the config, train, evaluate, export."""

from __future__ import annotations

import signal
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from data_pipelines.collate import processor_image_kwargs
from data_pipelines.formatting import judgment_as_prompt
from data_pipelines.images import image_bounds
from data_pipelines.readers import filter_by_prompt_length, read_records
from data_pipelines.records import PromptRecord
from data_pipelines.synthetic import heldout_seed, make_judgment_records, make_prompt_records, synthetic_task
from data_pipelines.video import use_video_settings
from reward_models.pool import RewardPool
from reward_models.scalar import HEAD_CONFIG, ScalarRewardModel
from vlrft.config import ConfigError
from vlrft.loop import Run, preempt_signals, training_run
from vlrft.models.loading import load_model
from vlrft.rollout import make_engine
from vlrft.rollout.trajectories import TrajectoryRunner
from vlrft.run_config import video_settings
from vlrft.strategies import make_strategy
from vlrft.strategies.placement import Placement, place
from vlrft.tools import ToolBox
from vlrft.trainer.async_rl import RolloutWorker, async_sampling, stream_layout
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.experience import draw_groups
from vlrft.trainer.heldout import heldout_eval
from vlrft.trainer.policy_trainer import PolicyTrainer
from vlrft.trainer.preflight import model_key, preflight_policy, record_check
from vlrft.trainer.teacher import check_teacher, make_teacher


def build_critic(cfg: PolicyTrainConfig, policy_path: str):
    """The PPO value model (a ScalarRewardModel read per token) and its own strategy instance."""

    path = cfg.critic.path or policy_path
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    if (Path(path) / HEAD_CONFIG).is_file():
        model = ScalarRewardModel.from_pretrained(path, dtype=dtype)
    else:
        model = ScalarRewardModel.from_backbone(path, dtype=dtype, seed=cfg.strategy.seed)
    # the critic trains its own parameters only: no LoRA on it, no frozen tower beyond the policy's choice
    return model, make_strategy(replace(cfg.strategy, lora_rank=0), replace(cfg.optim, lr=cfg.critic.lr))


def load_prompt_records(
    source: str, cfg: PolicyTrainConfig, size: int, seed: int, processor: Any, unique_ids: bool = False
) -> list[PromptRecord]:
    """``synthetic:TASK`` draws a synthetic task with ``seed``; anything else is read by data_pipelines.readers, its
    images sized by the processor's own pixel bounds."""
    judgments = cfg.data.record_kind == "judgment"  # judge RL: the verdict is the reference answer
    task = synthetic_task(source)
    if task is not None:
        options = dict(cfg.data.synthetic_options)
        if judgments:
            return [
                judgment_as_prompt(r)
                for r in make_judgment_records(
                    task, size, seed, judge_mode=cfg.data.judge_mode, paired=cfg.data.group_size == 2, **options
                )
            ]
        return make_prompt_records(task, size, seed=seed, **options)

    vision = getattr(processor, "image_processor", None) is not None
    bounds = image_bounds(processor) if vision else {}
    if cfg.tools.enabled:  # full resolution kept: tools cut from the originals (the processor resizes the prompt's)
        bounds = {**bounds, "max_pixels": None}
    records, _ = read_records(
        source,
        kind=cfg.data.record_kind,
        column_map=dict(cfg.data.column_map) or None,
        on_bad_record=cfg.data.on_bad_record,
        check=record_check(cfg.reward, vision, model_key(cfg)),
        unique_ids=unique_ids,
        **bounds,
    )
    return [judgment_as_prompt(r) for r in records] if judgments else records


def usable_prompts(
    cfg: PolicyTrainConfig, source: str, size: int, seed: int, processor: Any, tools: Any, unique_ids: bool = False
) -> list[PromptRecord]:
    """:func:`load_prompt_records` less the prompts longer than ``data.max_prompt_length`` (counted)."""
    records = load_prompt_records(source, cfg, size, seed, processor, unique_ids)
    return filter_by_prompt_length(
        records,
        processor,
        cfg.data.max_prompt_length,
        cfg.data.on_bad_record,
        system_prompt=cfg.data.system_prompt or None,
        prompt_template=cfg.data.prompt_template,
        tools=tools.schemas if tools is not None else None,
    )


def training_prompts(cfg: PolicyTrainConfig, processor: Any, tools: Any) -> list[PromptRecord]:
    """The training prompts, the same on every rank (trainers and async rollout ranks)."""
    return usable_prompts(cfg, cfg.data.train_source, cfg.data.synthetic_train_size, cfg.train.seed, processor, tools)


def train_policy(cfg: PolicyTrainConfig) -> dict[str, Any]:
    """Run ``vlrft train-policy`` with a resolved config; returns the summary (also in summary.json). With
    ``rollout.mode=async`` this process is a trainer or a rollout rank (``vlrft.strategies.placement``); a rollout
    rank serves the trainers (:func:`vlrft.trainer.async_rl.serve_rollouts`) and returns an empty summary."""
    placement = None
    if cfg.rollout.mode == "async":
        placement = place(cfg.rollout.asynchronous.rollout_ranks, cfg.strategy.timeout_s)
        if placement.is_rollout:
            return serve_rollouts(cfg, placement)
    with training_run(cfg, "train-policy", preflight_policy) as run:
        return _train_policy(cfg, run, placement)


def wait_for_the_trainers_stop(cfg: PolicyTrainConfig) -> None:
    """A rollout rank does not end on a preemption signal (``train.preempt_signals``) or a first Ctrl-C, which the
    launcher sends every rank: the trainers then save a checkpoint and send STOP, which ends it (a rollout rank that
    died first would make them stop without one). A second Ctrl-C ends it at once."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in preempt_signals(cfg.train.preempt_signals):
        signal.signal(sig, lambda signum, frame: None)

    def first_ctrl_c(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, first_ctrl_c)


def serve_rollouts(cfg: PolicyTrainConfig, placement: Placement) -> dict[str, Any]:
    """A rollout rank of ``rollout.mode=async`` (``vlrft.trainer.async_rl``): wait for the trainers' start, load the
    model they name (its weights then come with every version), build the engine, the reward pool and the tools as a
    colocated run does, and sample and score each step's share of prompts until the trainers stop it. Returns an
    empty summary: the trainers own the run folder and its outputs."""
    wait_for_the_trainers_stop(cfg)
    first = placement.trainer_ranks[0]
    hello = placement.recv_object(first, "the start of the run")
    strategy = make_strategy(replace(cfg.strategy, name="single"), cfg.optim)  # one process: the policy's kernels
    model, processor = load_model(hello["model_path"], cfg.model.dtype)
    use_video_settings(processor, **video_settings(cfg.data))
    model = strategy.prepare(model, trainable=False)[0]
    for work, _ in placement.send_object(stream_layout(model), first):
        placement._wait(work, first, "the weight layout")
    tools = ToolBox(cfg.tools, processor_image_kwargs(processor)) if cfg.tools.enabled else None
    pool = RewardPool(cfg.reward, device=strategy.device, prepare_model=strategy.compute_like_policy)
    engine = make_engine(cfg.rollout, model, processor, synced=False, distributed=False, device=strategy.device)
    trajectories = TrajectoryRunner(engine, processor, tools, cfg.tools) if tools is not None else None
    records = training_prompts(cfg, processor, tools)
    sampling = async_sampling(cfg.rollout.sampling())

    def draw(share: list[PromptRecord], keys: list[int], step: int, metrics: dict[str, float]):
        return draw_groups(engine, processor, share, sampling, cfg, pool, trajectories, metrics, keys)

    monitor = placement.watch(Path(cfg.train.output_dir) / ".liveness" / "async", cfg.strategy.heartbeat_timeout_s)
    try:
        RolloutWorker(placement, cfg, model, draw, records, hello, engine).run()
    finally:
        if monitor is not None:
            monitor.stop()
        pool.close()
        if tools is not None:
            tools.close()
    return {}


def _train_policy(cfg: PolicyTrainConfig, run: Run, placement: Placement | None = None) -> dict[str, Any]:
    strategy = run.strategy
    path = run.initial_model(tool_tokens=cfg.tools.enabled)
    model, processor = load_model(path, cfg.model.dtype, trains="model.path")
    use_video_settings(processor, **video_settings(cfg.data))
    tools = ToolBox(cfg.tools, processor_image_kwargs(processor)) if cfg.tools.enabled else None
    ref_model = teacher = None
    if cfg.algorithm.kl_coef > 0:
        ref_model, _ = strategy.prepare(load_model(path, cfg.model.dtype)[0], trainable=False)[:2]
    if not cfg.model.path:  # the tiny model built at the start (preflight checked a given one)
        for t in cfg.teacher.named().values():
            if t.path:
                check_teacher(t.path, path, run.print)
    if cfg.teacher.enabled:
        teacher = make_teacher(cfg, str(path), strategy, run.print)

    train_records = training_prompts(cfg, processor, tools)
    eval_records = (
        usable_prompts(
            cfg,
            cfg.data.eval_source,
            cfg.data.synthetic_eval_size,
            heldout_seed(cfg.train.seed),
            processor,
            tools,
            True,
        )
        if cfg.data.eval_source
        else []
    )
    if len(train_records) < cfg.rollout.rollout_batch_size:
        raise ConfigError(
            f"{cfg.data.train_source}: {len(train_records)} usable prompts, fewer than "
            f"rollout.rollout_batch_size={cfg.rollout.rollout_batch_size}"
        )
    pool = RewardPool(cfg.reward, device=strategy.device, prepare_model=strategy.compute_like_policy)
    critic = build_critic(cfg, path) if cfg.algorithm.estimator.critic else None
    accuracy = pool.accuracy_source
    if accuracy not in pool.graders:
        raise ConfigError(
            f"reward.accuracy_source={accuracy!r} must name a source of reward.sources that grades a response on its "
            f"own (a verifier or a function; these do: {sorted(pool.graders) or 'none'})"
        )
    accuracy_verifier = pool.graders[accuracy]
    total = run.total_steps(len(train_records) // cfg.rollout.rollout_batch_size)
    trainer = PolicyTrainer(
        cfg,
        strategy,
        model,
        processor,
        train_records,
        pool,
        eval_records=eval_records,
        ref_model=ref_model,
        teacher=teacher,
        accuracy=(accuracy, accuracy_verifier),
        critic=critic,
        evaluate_fn=heldout_eval if eval_records else None,
        total_steps=total,
        guard=run.guard,
        log=run.print,
        tools=tools,
        placement=placement,
        model_path=str(path),
    )
    try:
        header = f"{len(train_records)} training prompts, {len(eval_records)} held-out prompts, "
        if placement is not None:
            a = cfg.rollout.asynchronous
            header += f"async: {a.rollout_ranks} rollout rank(s), max staleness {a.max_staleness}, trainer "
        return run.fit(trainer, processor, total, header)
    finally:
        trainer.close()
        pool.close()
        if teacher is not None:
            teacher.close()
        if tools is not None:
            tools.close()
