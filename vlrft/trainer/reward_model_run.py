"""The reward-model trainers (SRM on preference pairs, GRM on judgment records).

Both kinds train as a :class:`~vlrft.supervised.SupervisedTrainer` in the one run driver (``vlrft.loop``: all
strategies, exact resume, checkpoints, tracker, export to ``final/``, ``summary.json``), as SFT and DPO do;
this module says what a batch and a loss are (:class:`SRMTask`, :class:`GRMTask`). Held-out accuracy every
``eval_every`` steps: pairwise accuracy (SRM, ``r(chosen) > r(rejected)`` on non-tied pairs) or judgment
accuracy (GRM: the greedy judgment's verdict equals the target's verdict), named as ``vlrft eval-reward-model``
names them.
"""

from __future__ import annotations

from typing import Any

import torch

from data_pipelines.collate import model_inputs
from data_pipelines.readers import read_records
from data_pipelines.records import media
from data_pipelines.synthetic import heldout_seed, make_judgment_records, make_preference_pairs, synthetic_task
from data_pipelines.video import use_video_settings
from reward_models.config import RewardModelTrainConfig
from reward_models.encoding import encode_responses, encode_sft
from reward_models.evaluate import judgment_counts, pair_counts, reward_metrics
from reward_models.generative import generate_judgments
from reward_models.losses import bradley_terry_loss, judge_sft_loss
from reward_models.scalar import ScalarRewardModel
from vlrft.loop import Run, training_run
from vlrft.models.loading import load_model
from vlrft.rollout import RolloutConfig, make_engine
from vlrft.run_config import video_settings
from vlrft.sampling import shared_chunks
from vlrft.supervised import SupervisedTrainer, steps_per_episode
from vlrft.trainer.preflight import preflight_reward_model


# -- data ----------------------------------------------------------------------------------------
def load_records(cfg: RewardModelTrainConfig) -> tuple[list, list]:
    """(train, held-out) records: PreferencePair for srm, JudgmentRecord for grm; synthetic:TASK sources are
    drawn with ``train.seed`` (held-out: :func:`~data_pipelines.synthetic.heldout_seed`), as every trainer's."""
    kind = "preference" if cfg.model.kind == "srm" else "judgment"
    d, seed = cfg.data, cfg.train.seed

    def draw(task: str, size: int, seed: int, paired: bool) -> list:
        opts = dict(d.synthetic_options)
        if kind == "preference":
            return make_preference_pairs(task, size, seed, **opts)
        return make_judgment_records(task, size, seed, judge_mode=cfg.judge.mode, paired=paired, **opts)

    task = synthetic_task(d.train_source)
    if task is not None:
        train = draw(task, d.synthetic_train_size, seed, d.group_size == 2)
    else:
        train = _read(d.train_source, kind, d.on_bad_record)
    eval_task = synthetic_task(d.eval_source)
    if eval_task is not None:
        return train, draw(eval_task, d.synthetic_eval_size, heldout_seed(seed), False)
    if d.eval_source:
        return train, _read(d.eval_source, kind, d.on_bad_record)
    if task is not None or not d.eval_fraction:
        return train, []
    n_eval = int(round(len(train) * d.eval_fraction))
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    return [train[i] for i in order[n_eval:]], [train[i] for i in order[:n_eval]]


def _read(source: str, kind: str, on_bad_record: str) -> list:

    records, report = read_records(source, kind=kind, on_bad_record=on_bad_record)
    if report.skipped:
        print(report.summary())
    return records


def _system(record: Any, cfg: RewardModelTrainConfig) -> str | None:
    return record.system or cfg.data.system_prompt or None


def srm_batch(processor: Any, pairs: list, cfg: RewardModelTrainConfig) -> dict:
    """Chosen conversations then rejected ones, in one right-padded batch of 2B rows."""
    items = [(p.prompt, media(p), p.chosen, _system(p, cfg)) for p in pairs]
    items += [(p.prompt, media(p), p.rejected, _system(p, cfg)) for p in pairs]
    ids = [p.id for p in pairs] * 2
    return encode_responses(processor, items, cfg.data.max_length, ids)


def grm_batch(processor: Any, records: list, cfg: RewardModelTrainConfig) -> dict:
    items = [(r.prompt, media(r), r.target, _system(r, cfg)) for r in records]
    return encode_sft(processor, items, cfg.data.max_length, [r.id for r in records])


# -- the tasks the supervised loop trains (vlrft.supervised) ----------------------------------------
class SRMTask:
    """Bradley-Terry on preference pairs: a batch is the chosen then the rejected conversations (2B rows);
    the loss unit is a pair."""

    def __init__(self, processor: Any, cfg: RewardModelTrainConfig, device: Any):
        self.processor, self.cfg, self.device = processor, cfg, device

    def encode(self, pairs: list) -> dict:
        batch = srm_batch(self.processor, pairs, self.cfg)
        batch["margin"] = torch.tensor([p.margin for p in pairs], dtype=torch.float32)
        batch["tie"] = torch.tensor([p.tie for p in pairs])
        return batch

    def units(self, batch: dict) -> float:
        return float(batch["tie"].numel())

    def tokens(self, pair: Any) -> int:
        return int(srm_batch(self.processor, [pair], self.cfg)["attention_mask"].sum())

    def loss(self, module: Any, batch: dict, total_units: float) -> tuple[torch.Tensor, dict]:
        rewards = module(**model_inputs(batch, self.device))
        b = batch["tie"].numel()
        chosen, rejected = rewards[:b], rewards[b:]
        tie = batch["tie"].to(rewards.device)
        margin = batch["margin"].to(rewards.device) if self.cfg.loss.use_margin else None
        per_pair = bradley_terry_loss(chosen, rejected, margin, tie, self.cfg.loss.tie_mode, self.cfg.loss.log_theta)
        with torch.no_grad():
            keep = ~tie
            acc = ((chosen > rejected) & keep).float().sum() / keep.float().sum().clamp(min=1)
        metrics = {
            "accuracy": acc,
            "reward_chosen": chosen.detach().mean(),
            "reward_rejected": rejected.detach().mean(),
        }
        return per_pair.sum() / total_units, metrics


class GRMTask:
    """Judge SFT (:func:`~reward_models.losses.judge_sft_loss`) on the target tokens; the loss unit is a
    target token, weighted ``verdict_loss_weight`` on the verdict's tokens."""

    def __init__(self, processor: Any, cfg: RewardModelTrainConfig, device: Any):
        self.processor, self.cfg, self.device = processor, cfg, device

    def encode(self, records: list) -> dict:
        return grm_batch(self.processor, records, self.cfg)

    def tokens(self, record: Any) -> int:
        return int(grm_batch(self.processor, [record], self.cfg)["attention_mask"].sum())

    def units(self, batch: dict) -> float:
        labelled = (batch["labels"][:, 1:] != -100).double()
        w = self.cfg.judge.verdict_loss_weight
        return float((labelled * (1 + (w - 1) * batch["verdict_mask"][:, 1:].double())).sum())

    def loss(self, module: Any, batch: dict, total_units: float) -> tuple[torch.Tensor, dict]:
        labels = batch["labels"].to(self.device)
        verdict = batch["verdict_mask"].to(self.device)
        logits = module(**model_inputs(batch, self.device)).logits
        mean = judge_sft_loss(logits, labels, verdict, self.cfg.judge.verdict_loss_weight)
        with torch.no_grad():
            hit = logits[:, :-1].argmax(-1) == labels[:, 1:]
            mask, verdict = labels[:, 1:] != -100, verdict[:, 1:]
            tok_acc = (hit & mask).sum() / mask.sum().clamp(min=1)
            verdict_acc = (hit & verdict).sum() / verdict.sum().clamp(min=1)
        # the batch's token mean back to its sum, over the step's units on all ranks
        return mean * (self.units(batch) / total_units), {
            "token_accuracy": tok_acc,
            "verdict_token_accuracy": verdict_acc,
        }


# -- evaluation ----------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model: Any, processor: Any, records: list, cfg: RewardModelTrainConfig, strategy: Any) -> dict:
    """Held-out pairwise accuracy (srm) or judgment accuracy (grm) over all ranks, named as
    ``vlrft eval-reward-model`` names them (``reward_models.evaluate.reward_metrics``)."""
    if cfg.train.max_eval_records:
        records = records[: cfg.train.max_eval_records]
    sums: dict[str, float] = {}
    model.eval()
    for recs, keep in shared_chunks(records, strategy.rank, strategy.world_size, cfg.train.eval_batch_size):
        real = [r for r, is_real in zip(recs, keep) if is_real]  # the padding forwards only keep ranks in step
        if cfg.model.kind == "srm":
            rewards = model(**model_inputs(srm_batch(processor, recs, cfg), strategy.device))
            chosen, rejected = rewards[: len(recs)][keep], rewards[len(recs) :][keep]
            counts = pair_counts(chosen, rejected, [r.tie for r in real])
        else:
            items = [(r.prompt, r.images, _system(r, cfg)) for r in recs]
            engine = make_engine(
                RolloutConfig.on_model(micro_batch_size=len(items)),
                strategy.unwrap(model),
                processor,
                synced=strategy.shards_parameters,
            )
            texts = generate_judgments(engine, processor, items, cfg.judge.max_new_tokens)
            kept = [t for t, is_real in zip(texts, keep) if is_real]
            counts = judgment_counts(kept, [r.target for r in real], cfg.judge.mode, cfg.judge.score_max)
        for k, v in counts.items():
            sums[k] = sums.get(k, 0.0) + v
    model.train()
    keys = sorted(sums) or ["correct", "counted"]
    totals = strategy.all_reduce(torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64), op="sum")
    return reward_metrics(cfg.model.kind, dict(zip(keys, totals.tolist())))


# -- the run ---------------------------------------------------------------------------------------
def build_model(cfg: RewardModelTrainConfig, path: str) -> tuple[torch.nn.Module, Any]:
    """The model to train (from ``path``) and its processor (tokenizer for text-only checkpoints)."""
    grm = cfg.model.kind == "grm"
    model, processor = load_model(path, cfg.model.dtype, lm_head=grm, trains="model.path")  # an SRM: the base model
    if grm:
        return model, processor
    return ScalarRewardModel(model, cfg.model.pooling, seed=cfg.strategy.seed), processor


CONSOLE_KEYS = ("train/loss", "train/accuracy", "train/verdict_token_accuracy", "eval/")


def train_reward_model(cfg: RewardModelTrainConfig, records: tuple[list, list] | None = None) -> dict:
    """Train, evaluate and export a reward model to ``output_dir/final``; returns the run's summary (also
    ``summary.json``: held-out metrics before and after).

    ``records`` = (train, held-out) in memory replaces ``cfg.data`` (programmatic use). The checks of
    ``vlrft.trainer.preflight.preflight_reward_model`` (model folder, data, output folder) run before anything heavy.
    """
    with training_run(cfg, "train-reward-model", preflight_reward_model) as run:
        return _train(cfg, run, records)


def _train(cfg: RewardModelTrainConfig, run: Run, records: tuple[list, list] | None) -> dict:
    strategy, t = run.strategy, cfg.train
    path = run.initial_model()
    train, held_out = records if records is not None else load_records(cfg)
    if not train:
        raise ValueError("no training records (check data.train_source)")
    model, processor = build_model(cfg, path)
    use_video_settings(processor, **video_settings(cfg.data))
    total = run.total_steps(steps_per_episode(len(train), t.batch_size, strategy.world_size))
    model, _, _ = strategy.prepare(model, total_steps=total)
    task = (SRMTask if cfg.model.kind == "srm" else GRMTask)(processor, cfg, strategy.device)
    trainer = SupervisedTrainer(
        strategy,
        task,
        train,
        batch_size=t.batch_size,
        seed=t.seed,
        guard=run.guard,
        group_size=cfg.data.group_size,
        micro_batch_tokens=t.micro_batch_tokens,
        evaluate=(lambda: evaluate(model, processor, held_out, cfg, strategy)) if held_out else None,
        console_keys=CONSOLE_KEYS,
    )
    trainer.best_metric = "pairwise_accuracy" if cfg.model.kind == "srm" else "judgment_accuracy"  # best/ follows it
    header = f"{cfg.model.kind}: {len(train)} train / {len(held_out)} held-out records, "
    return run.fit(trainer, processor, total, header)
