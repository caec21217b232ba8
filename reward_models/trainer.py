"""The reward-model training loop (SRM on preference pairs, GRM on judgment records), top to bottom.

One loop for both kinds and all strategies (single, FSDP2, DeepSpeed): the data order is a pure
function of (seed, step), so a checkpoint needs only the strategy's state, the step and the RNG
states to resume exactly. Held-out accuracy every ``eval_every`` steps: pairwise accuracy (SRM,
``r(chosen) > r(rejected)`` on non-tied pairs) or judgment accuracy (GRM: the greedy judgment's
verdict equals the target's verdict).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from data_pipelines.collate import model_inputs
from data_pipelines.readers import read_records
from data_pipelines.synthetic import make_judgment_records, make_preference_pairs
from reward_models.config import RewardModelTrainConfig
from reward_models.encoding import encode_responses, encode_sft
from reward_models.generative import generate_judgments, parse_judgment
from reward_models.losses import bradley_terry_loss, judge_sft_loss
from reward_models.scalar import ScalarRewardModel
from vlrft import checkpoints
from vlrft.config import save_config
from vlrft.models.loading import load_model
from vlrft.models.tiny import make_tiny_model
from vlrft.rollout import make_engine
from vlrft.sampling import REWARD_ORDER_STRIDE, seeded_permutation
from vlrft.strategies import make_strategy, rng_state, seed_everything, set_rng_state
from vlrft.tracking import Tracker


# -- data ----------------------------------------------------------------------------------------
def load_records(cfg: RewardModelTrainConfig) -> tuple[list, list]:
    """(train, held-out) records: PreferencePair for srm, JudgmentRecord for grm."""
    kind = "preference" if cfg.model.kind == "srm" else "judgment"
    d = cfg.data
    if not d.train_source:
        opts = dict(d.synthetic_options)
        if kind == "preference":
            return (
                make_preference_pairs(d.synthetic_task, d.synthetic_train_size, d.synthetic_seed, **opts),
                make_preference_pairs(d.synthetic_task, d.synthetic_eval_size, d.synthetic_seed + 1, **opts),
            )

        mode = cfg.judge.mode
        return (
            make_judgment_records(
                d.synthetic_task,
                d.synthetic_train_size,
                d.synthetic_seed,
                judge_mode=mode,
                paired=d.group_size == 2,
                **opts,
            ),
            make_judgment_records(
                d.synthetic_task, d.synthetic_eval_size, d.synthetic_seed + 1, judge_mode=mode, **opts
            ),
        )
    train = _read(d.train_source, kind, d.on_bad_record)
    if d.eval_source:
        return train, _read(d.eval_source, kind, d.on_bad_record)
    n_eval = int(round(len(train) * d.eval_fraction))
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(d.synthetic_seed)).tolist()
    return [train[i] for i in order[n_eval:]], [train[i] for i in order[:n_eval]]


def _read(source: str, kind: str, on_bad_record: str) -> list:

    records, report = read_records(source, kind=kind, on_bad_record=on_bad_record)
    if report.skipped:
        print(report.summary())
    return records


def batch_indices(
    n: int, step: int, batch_size: int, rank: int, world: int, seed: int, group_size: int = 1
) -> list[int]:
    """This rank's record indices at ``step``: consecutive slices of per-epoch permutations.

    With ``group_size`` g > 1, groups of g consecutive records (e.g. a prompt's right and wrong
    candidate) are permuted as units and stay next to each other (``batch_size`` should be a multiple of g).
    """
    n_groups = n // group_size
    global_bs = batch_size * world
    start = step * global_bs + rank * batch_size
    orders: dict[int, list[int]] = {}
    out = []
    for pos in range(start, start + batch_size):
        epoch, i = divmod(pos, n_groups * group_size)
        if epoch not in orders:
            orders[epoch] = seeded_permutation(n_groups, seed, epoch, stride=REWARD_ORDER_STRIDE)
        group, offset = divmod(i, group_size)
        out.append(orders[epoch][group] * group_size + offset)
    return out


def _system(record: Any, cfg: RewardModelTrainConfig) -> str | None:
    return record.system or cfg.data.system_prompt or None


def srm_batch(processor: Any, pairs: list, cfg: RewardModelTrainConfig) -> dict:
    """Chosen conversations then rejected ones, in one right-padded batch of 2B rows."""
    items = [(p.prompt, p.images, p.chosen, _system(p, cfg)) for p in pairs]
    items += [(p.prompt, p.images, p.rejected, _system(p, cfg)) for p in pairs]
    ids = [p.id for p in pairs] * 2
    return encode_responses(processor, items, cfg.data.max_length, ids)


def grm_batch(processor: Any, records: list, cfg: RewardModelTrainConfig) -> dict:
    items = [(r.prompt, r.images, r.target, _system(r, cfg)) for r in records]
    return encode_sft(processor, items, cfg.data.max_length, [r.id for r in records])


# -- losses --------------------------------------------------------------------------------------
def srm_loss(model: Any, batch: dict, pairs: list, cfg: RewardModelTrainConfig, device) -> tuple[torch.Tensor, dict]:
    rewards = model(**model_inputs(batch, device))
    b = len(pairs)
    chosen, rejected = rewards[:b], rewards[b:]
    margin = torch.tensor([p.margin for p in pairs], device=rewards.device) if cfg.loss.use_margin else None
    tie = torch.tensor([p.tie for p in pairs], device=rewards.device)
    loss = bradley_terry_loss(chosen, rejected, margin, tie, cfg.loss.tie_mode, cfg.loss.log_theta).mean()
    with torch.no_grad():
        keep = ~tie
        acc = ((chosen > rejected) & keep).float().sum() / keep.float().sum().clamp(min=1)
    return loss, {
        "loss": loss.detach(),
        "accuracy": acc,
        "reward_chosen": chosen.detach().mean(),
        "reward_rejected": rejected.detach().mean(),
    }


def grm_loss(model: Any, batch: dict, device, verdict_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    """Judge SFT loss on the target tokens only (:func:`~reward_models.losses.judge_sft_loss`)."""
    labels = batch["labels"].to(device)
    verdict = batch["verdict_mask"].to(device)
    logits = model(**model_inputs(batch, device)).logits
    loss = judge_sft_loss(logits, labels, verdict, verdict_weight)
    with torch.no_grad():
        hit = logits[:, :-1].argmax(-1) == labels[:, 1:]
        mask, verdict = labels[:, 1:] != -100, verdict[:, 1:]
        tok_acc = (hit & mask).sum() / mask.sum().clamp(min=1)
        verdict_acc = (hit & verdict).sum() / verdict.sum().clamp(min=1)
    return loss, {"loss": loss.detach(), "token_accuracy": tok_acc, "verdict_token_accuracy": verdict_acc}


# -- evaluation ----------------------------------------------------------------------------------
def _shard(records: list, rank: int, world: int) -> list[tuple[Any, bool]]:
    """This rank's held-out records, padded so every rank runs the same number of forwards."""
    per_rank = math.ceil(len(records) / world)
    mine = [(records[i], True) for i in range(rank, len(records), world)]
    return mine + [(records[0], False)] * (per_rank - len(mine))


@torch.no_grad()
def evaluate(model: Any, processor: Any, records: list, cfg: RewardModelTrainConfig, strategy: Any) -> dict:
    """Held-out pairwise accuracy (srm) or judgment accuracy (grm), over all ranks."""
    if cfg.train.max_eval_records:
        records = records[: cfg.train.max_eval_records]
    shard = _shard(records, strategy.rank, strategy.world_size)
    bs = cfg.train.eval_batch_size
    correct = counted = unparsable = 0
    model.eval()
    for start in range(0, len(shard), bs):
        chunk = shard[start : start + bs]
        recs, real = [r for r, _ in chunk], [ok for _, ok in chunk]
        if cfg.model.kind == "srm":
            rewards = model(**model_inputs(srm_batch(processor, recs, cfg), strategy.device)).float()
            ok = (rewards[: len(recs)] > rewards[len(recs) :]).tolist()
            for rec, good, is_real in zip(recs, ok, real):
                if is_real and not rec.tie:
                    correct, counted = correct + int(good), counted + 1
        else:
            items = [(r.prompt, r.images, _system(r, cfg)) for r in recs]
            engine = make_engine(
                "hf", strategy.unwrap(model), processor, synced=strategy.shards_parameters, micro_batch_size=len(items)
            )
            texts = generate_judgments(engine, processor, items, cfg.judge.max_new_tokens)
            for rec, text, is_real in zip(recs, texts, real):
                want = parse_judgment(rec.target, cfg.judge.mode, cfg.judge.score_max)
                got = parse_judgment(text, cfg.judge.mode, cfg.judge.score_max)
                if is_real and want is not None:
                    counted += 1
                    correct += int(got == want)
                    unparsable += int(got is None)
    model.train()
    totals = strategy.all_reduce(torch.tensor([correct, counted, unparsable], dtype=torch.float64), op="sum")
    correct, counted, unparsable = totals.tolist()
    name = "pairwise_accuracy" if cfg.model.kind == "srm" else "judgment_accuracy"
    out = {f"eval/{name}": correct / max(counted, 1), "eval/n": counted}
    if cfg.model.kind == "grm":
        out["eval/unparsable"] = unparsable
    return out


# -- the loop ------------------------------------------------------------------------------------
def build_model(cfg: RewardModelTrainConfig) -> tuple[torch.nn.Module, Any]:
    """The model to train and its processor (tokenizer for text-only checkpoints)."""

    if not cfg.model.path:
        raise ValueError("model.path is empty (train_reward_model fills it with a tiny model first)")
    grm = cfg.model.kind == "grm"
    model, processor = load_model(cfg.model.path, cfg.model.dtype, lm_head=grm)  # an SRM takes the base model
    if grm:
        return model, processor
    return ScalarRewardModel(model, cfg.model.pooling, seed=cfg.strategy.seed), processor


def train_reward_model(cfg: RewardModelTrainConfig, records: tuple[list, list] | None = None) -> dict:
    """Train, evaluate and export a reward model; returns the final metrics.

    ``records`` = (train, held-out) in memory replaces ``cfg.data`` (programmatic use).
    """

    out = Path(cfg.train.output_dir)
    strategy = make_strategy(cfg.strategy, cfg.optim)
    if not cfg.model.path:  # a tiny random Qwen2.5-VL (same seed, same bytes on every rank)
        tiny = out / "tiny_base"
        if strategy.is_rank0 and not (tiny / "vlrft_tiny.json").is_file():
            make_tiny_model(tiny, arch="qwen2_5_vl", seed=cfg.strategy.seed)
        strategy.barrier()
        cfg.model.path = str(tiny)
    seed_everything(cfg.strategy.seed)
    train, held_out = records if records is not None else load_records(cfg)
    if not train:
        raise ValueError("no training records (check data.train_source)")
    model, processor = build_model(cfg)
    model, _, _ = strategy.prepare(model, total_steps=cfg.train.max_steps)
    ckpt_root = out / "checkpoints"
    start = 0
    resume = checkpoints.resume_path(ckpt_root, cfg.train.resume)
    if resume is not None:
        client = strategy.load_checkpoint(resume)
        start = client["step"]
        set_rng_state(client["rng"])
    tracker = Tracker(out, cfg, strategy.is_rank0, start, cfg.train.max_steps, desc="train-reward-model")
    if strategy.is_rank0:
        save_config(cfg, out)
        tracker.print(
            f"{cfg.model.kind}: {len(train)} train / {len(held_out)} held-out records, "
            f"world size {strategy.world_size}, " + (f"resumed from {resume}" if resume else "from scratch")
        )
    if start == 0 and held_out:
        tracker.log(evaluate(model, processor, held_out, cfg, strategy), 0)
    model.train()
    sums: dict[str, float] = {}
    n_acc, t0 = 0, time.time()
    for step in range(start, cfg.train.max_steps):
        idx = batch_indices(
            len(train),
            step,
            cfg.train.batch_size,
            strategy.rank,
            strategy.world_size,
            cfg.strategy.seed,
            cfg.data.group_size,
        )
        records = [train[i] for i in idx]
        if cfg.model.kind == "srm":
            loss, metrics = srm_loss(model, srm_batch(processor, records, cfg), records, cfg, strategy.device)
        else:
            loss, metrics = grm_loss(
                model, grm_batch(processor, records, cfg), strategy.device, cfg.judge.verdict_loss_weight
            )
        strategy.backward(loss)
        metrics["grad_norm"] = torch.tensor(strategy.step())
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        n_acc += 1
        done = step + 1
        tracker.advance(float(loss.detach()))
        if done % cfg.train.log_every == 0 or done == cfg.train.max_steps:
            avg = torch.tensor([sums[k] / n_acc for k in sorted(sums)], dtype=torch.float64)
            avg = strategy.all_reduce(avg, op="mean")
            row = {f"train/{k}": v for k, v in zip(sorted(sums), avg.tolist())}
            row["train/lr"] = strategy.lr
            row["train/steps_per_s"] = n_acc / max(time.time() - t0, 1e-9)
            tracker.log(row, done)
            sums, n_acc, t0 = {}, 0, time.time()
        if held_out and cfg.train.eval_every and done % cfg.train.eval_every == 0 and done != cfg.train.max_steps:
            tracker.log(evaluate(model, processor, held_out, cfg, strategy), done)
        if cfg.train.save_every and done % cfg.train.save_every == 0 and done != cfg.train.max_steps:
            _save(strategy, ckpt_root, done, cfg.train.keep_last)
    final = evaluate(model, processor, held_out, cfg, strategy) if held_out else {}
    tracker.log(final, cfg.train.max_steps)
    _save(strategy, ckpt_root, cfg.train.max_steps, cfg.train.keep_last)
    model_dir = out / "model"
    strategy.save_pretrained(model_dir, processor)
    tracker.close()
    if strategy.is_rank0:
        (out / "final_metrics.json").write_text(json.dumps(final, indent=2) + "\n")
    return final


def _save(strategy: Any, root: Path, step: int, keep_last: int) -> None:
    if not (checkpoints.checkpoint_dir(root, step) / "COMPLETE").is_file():  # a resumed finished run
        checkpoints.save_checkpoint(strategy, root, step, {"step": step, "rng": rng_state()}, keep_last)
