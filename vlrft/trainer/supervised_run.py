"""``vlrft train-sft`` and ``vlrft train-dpo`` end to end: data, model, reference, tasks, held-out evaluation.

Both train in the one supervised trainer (``vlrft.supervised.SupervisedTrainer``, a plug-in of the one run driver
``vlrft.loop.Run.fit``); this module says what their batches
and losses are:

- :class:`SFTTask`: conversations with labels on assistant tokens only (``data_pipelines.chat``), the
  masked token NLL over the step's global token count (``vlrft.algorithms.sft``);
- :class:`DPOTask`: a pair's chosen and rejected conversations in ONE forward (2B rows); the frozen
  reference's log-probs computed once per pair in the same layout (or precomputed in a first pass with
  ``dpo.precompute_ref``, after which the reference is freed); the preference loss of
  ``vlrft.algorithms.preference``.

Held-out evaluation before and after: greedy answer accuracy through the eval harness and a rollout
engine (both), held-out NLL on the demonstrations (SFT), implicit-reward preference accuracy (DPO).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from data_pipelines.chat import (
    ChatRecord,
    EncodedChat,
    chat_from_prompt,
    collate_chats,
    encode_chat,
    pair_conversations,
    read_chat_records,
)
from data_pipelines.collate import model_inputs, processor_image_kwargs, tokenizer_of
from data_pipelines.errors import DataError
from data_pipelines.images import image_bounds
from data_pipelines.readers import read_records
from data_pipelines.records import PreferencePair, PromptRecord
from data_pipelines.synthetic import heldout_seed, make_preference_pairs, make_prompt_records, synthetic_task
from data_pipelines.video import counting_videos, use_video_settings
from eval.benchmarks import user_benchmark
from eval.runner import evaluate as run_eval
from vlrft.algorithms import logprobs_from_logits, preference_loss, rpo_loss, sft_loss, shifted_targets
from vlrft.config import ConfigError
from vlrft.loop import Run, training_run
from vlrft.models.loading import load_model
from vlrft.rollout import RolloutConfig, make_engine
from vlrft.rollout.trajectories import TrajectoryRunner
from vlrft.run_config import video_settings
from vlrft.sampling import share_over_ranks, shared_chunks
from vlrft.supervised import SupervisedTrainer, steps_per_episode
from vlrft.tools import CallError, ToolBox, ToolCall, format_tool_call
from vlrft.tools.base import tool_message
from vlrft.tools.builtin import view_of
from vlrft.trainer.preflight import preflight_supervised
from vlrft.trainer.supervised_config import DPOTrainConfig, SFTTrainConfig

CONSOLE_KEYS = ("train/loss", "train/token_accuracy", "train/rewards/", "eval/")


# -- data -----------------------------------------------------------------------------------------
def _bounds(processor: Any) -> dict[str, int]:
    return image_bounds(processor) if getattr(processor, "image_processor", None) is not None else {}


def _read(source: str, kind: str, cfg: Any, processor: Any) -> list:
    records, report = read_records(source, kind=kind, on_bad_record=cfg.data.on_bad_record, **_bounds(processor))
    if report.skipped:
        print(report.summary())
    return records


def prompt_records(cfg: Any, processor: Any) -> list[PromptRecord]:
    """Held-out prompts with answers (greedy accuracy): synthetic, prompt records, or the eval pairs' prompts."""
    d = cfg.data
    if not d.eval_source:
        return []
    task = synthetic_task(d.eval_source)
    if task is not None:
        return make_prompt_records(task, d.synthetic_eval_size, heldout_seed(cfg.train.seed), **d.synthetic_options)
    if isinstance(cfg, DPOTrainConfig):
        return [pair_prompt(p) for p in preference_pairs(d.eval_source, d.synthetic_eval_size, 0, cfg, processor)]
    return _read(d.eval_source, "prompt", cfg, processor)


def pair_prompt(pair: PreferencePair) -> PromptRecord:
    """A pair's prompt with its chosen answer (``ground_truth`` for synthetic pairs) as the reference."""
    answer = pair.metadata.get("ground_truth", pair.chosen)
    return PromptRecord(
        pair.id, pair.prompt, pair.images, str(answer), pair.task, pair.system, pair.metadata, videos=pair.videos
    )


def preference_pairs(source: str, size: int, seed: int, cfg: Any, processor: Any) -> list[PreferencePair]:
    task = synthetic_task(source)
    if task is None:
        return _read(source, "preference", cfg, processor)
    return make_preference_pairs(
        task, size, seed, response_template=cfg.data.response_template, **cfg.data.synthetic_options
    )


def sft_records(cfg: SFTTrainConfig, processor: Any, tools: ToolBox | None = None) -> list[ChatRecord]:
    d = cfg.data
    task = synthetic_task(d.train_source)
    if task is None:
        records, report = read_chat_records(d.train_source, on_bad_record=d.on_bad_record, processor=processor)
        if report.skipped:
            print(report.summary())
        return records
    prompts = make_prompt_records(task, d.synthetic_train_size, cfg.train.seed, **d.synthetic_options)
    return [_demonstration(r, cfg, tools) for r in prompts]


def _demonstration(record: PromptRecord, cfg: Any, tools: ToolBox | None = None) -> ChatRecord:
    """The record answered by ``data.response_template``; with tools, a record whose task says which calls solve
    it (``metadata["demonstration"]``) gets them first, each answered by the real tool (a tool trajectory)."""
    d = cfg.data
    chat = chat_from_prompt(
        record,
        d.response_template.format(answer=record.answer),
        system_prompt=d.system_prompt or None,
        prompt_template=d.prompt_template,
    )
    calls = record.metadata.get("demonstration") if tools is not None else None
    if not calls:
        return chat
    views = [view_of(im, tools.bounds) for im in record.images]
    turns = []
    for call in calls:
        result = tools.run(ToolCall(call["name"], call["arguments"]), views)
        if isinstance(result, CallError):
            raise DataError(f"its demonstration's call failed: {result.message}").located(source=record.id)
        turns += [{"role": "assistant", "content": [{"type": "text", "text": format_tool_call(**call)}]}]
        turns += [tool_message(result)]
        views += [view_of(im, tools.bounds) for im in result.images]
    return replace(chat, messages=chat.messages[:-1] + turns + chat.messages[-1:])


# -- log-probs ------------------------------------------------------------------------------------
def sequence_logprobs(module: Any, batch: dict, device: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token log-probs [N, T-1], target mask [N, T-1], summed log-prob of the labelled tokens [N])``."""
    logits = module(**model_inputs(batch, device)).logits
    targets, mask = shifted_targets(batch["labels"].to(device))
    logps = logprobs_from_logits(logits[:, :-1], targets)
    return logps, mask, (logps * mask).sum(-1)


class _Encoder:
    """Encodes conversations once per record (cached) and collates them (``tools``: the schemas listed). A
    conversation with videos is encoded again each time a batch takes it and never cached: its frames are decoded
    per batch, not held for the whole dataset; its length is counted from the videos' headers."""

    def __init__(self, processor: Any, max_length: int, tools: list[dict] | None = None):
        self.processor, self.max_length, self.tools = processor, max_length, tools
        self.pad = tokenizer_of(processor).pad_token_id
        self.cache: dict[int, EncodedChat] = {}
        self.lengths: dict[int, int] = {}

    def chat(self, record: ChatRecord) -> EncodedChat:
        key = id(record)
        if key in self.cache:
            return self.cache[key]
        encoded = encode_chat(self.processor, record, self.max_length, self.tools)
        if not record.videos:
            self.cache[key] = encoded
        return encoded

    def length(self, record: ChatRecord) -> int:
        """The conversation's tokens (videos counted from their headers, no frame decoded)."""
        key = id(record)
        if key not in self.lengths:
            if record.videos:
                with counting_videos(self.processor):
                    encoded = encode_chat(self.processor, record, self.max_length, self.tools)
            else:
                encoded = self.chat(record)
            self.lengths[key] = int(encoded.input_ids.numel())
        return self.lengths[key]

    def collate(self, records: list[ChatRecord]) -> dict:
        return collate_chats([self.chat(r) for r in records], self.pad)


class SFTTask:
    """Masked token NLL on assistant tokens; the loss unit is a target token (token-mean) or a sequence."""

    def __init__(self, processor: Any, cfg: SFTTrainConfig, device: Any, tools: list[dict] | None = None):
        self.enc = _Encoder(processor, cfg.data.max_length, tools)
        self.mode, self.device = cfg.sft.loss_agg_mode, device

    def encode(self, records: list[ChatRecord]) -> dict:
        return self.enc.collate(records)

    def tokens(self, record: ChatRecord) -> int:
        return self.enc.length(record)

    def units(self, batch: dict) -> float:
        mask = batch["labels"][:, 1:] != -100
        return float(mask.sum() if self.mode == "token-mean" else (mask.sum(-1) > 0).sum())

    def loss(self, module: Any, batch: dict, total_units: float) -> tuple[torch.Tensor, dict]:
        logps, mask, _ = sequence_logprobs(module, batch, self.device)
        count = {"global_token_count" if self.mode == "token-mean" else "num_sequences": total_units}
        loss = sft_loss(logps, mask, loss_agg_mode=self.mode, **count)
        with torch.no_grad():
            token_acc = ((logps > -0.6931) & mask).sum() / mask.sum().clamp(min=1)  # p(target) > 1/2
        return loss, {"token_accuracy": token_acc}


class DPOTask:
    """Preference loss on pairs; chosen and rejected in one forward, reference log-probs once per pair."""

    def __init__(self, processor: Any, cfg: DPOTrainConfig, strategy: Any, ref_model: Any, pairs: list[PreferencePair]):
        self.enc, self.cfg, self.device, self.ref = (
            _Encoder(processor, cfg.data.max_length),
            cfg,
            strategy.device,
            ref_model,
        )
        self.convs: dict[int, tuple[ChatRecord, ChatRecord]] = {}
        # the reference log-probs of a pair are computed once, in the layout of the batch it first appears in;
        # they are part of the checkpoint (by the pair's position in ``pairs``, the run's train then held-out
        # pairs), so a resumed run uses the values the uninterrupted run computed before the checkpoint rather
        # than recomputing them in another batch's layout, whose matrix shapes may round differently on another
        # CPU (an Intel AVX-512 machine did; MKL_CBWR=COMPATIBLE does here: tests/test_run_lifecycle.py)
        self.position = {id(p): i for i, p in enumerate(pairs)}
        self.ref_logps: dict[int, tuple[float, float]] = {}  # by position
        # a sharded reference forwards in lockstep on all ranks, so it is not skipped for pairs one rank has
        # seen (with dpo.precompute_ref every rank computes every pair once, up front)
        self.reuse = not strategy.shards_parameters

    def state_dict(self) -> dict[str, Any]:
        return {"ref_logps": dict(self.ref_logps)} if self.reuse else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ref_logps.update(state.get("ref_logps", {}))

    def conversations(self, pair: PreferencePair) -> tuple[ChatRecord, ChatRecord]:
        if id(pair) not in self.convs:
            d = self.cfg.data
            self.convs[id(pair)] = pair_conversations(
                pair, system_prompt=d.system_prompt or None, prompt_template=d.prompt_template
            )
        return self.convs[id(pair)]

    @torch.no_grad()
    def reference(self, pairs: list[PreferencePair], batch: dict | None = None) -> torch.Tensor:
        """Reference log-probs ``[2B]`` (chosen then rejected), from the cache or one reference forward."""
        key = self.position.__getitem__
        missing = [p for p in pairs if key(id(p)) not in self.ref_logps or (self.ref is not None and not self.reuse)]
        if missing:
            if self.ref is None:
                raise RuntimeError("reference log-probs missing and the reference model was freed")
            if batch is None or len(missing) != len(pairs):
                batch = self.encode_pairs(missing)
            _, _, seq = sequence_logprobs(self.ref, batch, self.device)
            b = len(missing)
            for i, p in enumerate(missing):
                self.ref_logps[key(id(p))] = (float(seq[i]), float(seq[b + i]))
        values = [self.ref_logps[key(id(p))] for p in pairs]
        return torch.tensor([c for c, _ in values] + [r for _, r in values], dtype=torch.float64)

    def encode_pairs(self, pairs: list[PreferencePair]) -> dict:
        convs = [self.conversations(p) for p in pairs]
        return self.enc.collate([c for c, _ in convs] + [r for _, r in convs])

    def encode(self, pairs: list[PreferencePair]) -> dict:
        batch = self.encode_pairs(pairs)
        batch["ref_logps"] = self.reference(pairs, batch)
        return batch

    def units(self, batch: dict) -> float:
        return float(batch["ref_logps"].numel() // 2)

    def tokens(self, pair: PreferencePair) -> int:
        return sum(self.enc.length(c) for c in self.conversations(pair))

    def pair_losses(self, module: Any, batch: dict) -> tuple[torch.Tensor, dict]:
        _, mask, seq = sequence_logprobs(module, batch, self.device)
        b = seq.numel() // 2
        ref = batch["ref_logps"].to(self.device, seq.dtype)
        d = self.cfg.dpo
        per_pair, metrics = preference_loss(
            seq[:b],
            seq[b:],
            ref[:b],
            ref[b:],
            loss_type=d.loss_type,
            beta=d.beta,
            label_smoothing=d.label_smoothing,
        )
        return rpo_loss(per_pair, seq[:b], mask[:b].sum(-1), d.rpo_alpha), metrics

    def loss(self, module: Any, batch: dict, total_units: float) -> tuple[torch.Tensor, dict]:
        per_pair, metrics = self.pair_losses(module, batch)
        return per_pair.sum() / total_units, {k: v.mean() for k, v in metrics.items()}


# -- held-out evaluation --------------------------------------------------------------------------
def _shared_chunks(records: list, strategy: Any, size: int):
    """:func:`~vlrft.sampling.shared_chunks` of this rank, each chunk's keep flags as a float mask."""
    for chunk, keep in shared_chunks(records, strategy.rank, strategy.world_size, size):
        yield chunk, torch.tensor(keep, dtype=torch.float64)


def greedy_accuracy(
    strategy: Any, processor: Any, records: list[PromptRecord], cfg: Any, tools: ToolBox | None = None
) -> dict[str, float]:
    """Greedy held-out answer accuracy through the eval harness and an hf engine on the trained model (with
    ``tools``: trajectories, ``eval_max_new_tokens`` per turn)."""
    mine, counted = share_over_ranks(records, strategy.rank, strategy.world_size)
    model = strategy.unwrap()
    engine = make_engine(
        RolloutConfig.on_model(micro_batch_size=16),
        model,
        processor,
        synced=strategy.shards_parameters,
        device=strategy.device,
    )
    trajectories = TrajectoryRunner(engine, processor, tools, cfg.tools) if tools is not None else None
    metrics = run_eval(
        model,
        processor,
        mine,
        user_benchmark("heldout", cfg.train.eval_verifier, cfg.data.prompt_template),
        n=1,
        temperature=0.0,
        max_new_tokens=cfg.train.eval_max_new_tokens,
        batch_size=cfg.train.eval_batch_size,
        seed=cfg.train.seed,
        system_prompt=cfg.data.system_prompt or None,
        engine=engine,
        trajectories=trajectories,
        uncounted=len(mine) - counted,
    )
    total = strategy.all_reduce(
        torch.tensor([counted, metrics.get("accuracy", 0.0) * counted], dtype=torch.float64), op="sum"
    ).tolist()
    return {"accuracy": total[1] / max(total[0], 1), "n": total[0]}


def _batched(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


@torch.no_grad()
def heldout_nll(strategy: Any, task: SFTTask, records: list[ChatRecord], batch_size: int) -> dict[str, float]:
    """Token-mean NLL of the held-out demonstrations."""
    module = strategy.train_module
    module.eval()
    nll = tokens = 0.0
    for chunk, real in _shared_chunks(records, strategy, batch_size):
        logps, mask, _ = sequence_logprobs(module, task.encode(chunk), strategy.device)
        mask = mask * real.to(mask)[:, None]
        nll, tokens = nll - float((logps * mask).sum()), tokens + float(mask.sum())
    total = strategy.all_reduce(torch.tensor([nll, tokens], dtype=torch.float64), op="sum").tolist()
    return {"nll": total[0] / max(total[1], 1)}


@torch.no_grad()
def heldout_preferences(strategy: Any, task: DPOTask, pairs: list[PreferencePair], batch_size: int) -> dict:
    """Implicit-reward preference accuracy (``beta log pi/pi_ref`` of chosen > rejected; a tie is a miss)."""
    module = strategy.train_module
    module.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    for chunk, real in _shared_chunks(pairs, strategy, batch_size):
        _, metrics = task.pair_losses(module, task.encode(chunk))
        acc, margin = (float((metrics[k] * real.to(metrics[k])).sum()) for k in ("rewards/accuracy", "rewards/margins"))
        sums += torch.tensor([real.sum(), acc, margin], dtype=torch.float64)
    n, acc, margin = strategy.all_reduce(sums, op="sum").tolist()
    return {"preference_accuracy": acc / max(n, 1), "reward_margin": margin / max(n, 1)}


# -- the runs -------------------------------------------------------------------------------------
def _trainer(run: Run, task: Any, records: list, evaluate: Any) -> SupervisedTrainer:
    t = run.train
    return SupervisedTrainer(
        run.strategy,
        task,
        records,
        batch_size=t.batch_size,
        seed=t.seed,
        guard=run.guard,
        micro_batch_size=t.micro_batch_size,
        micro_batch_tokens=t.micro_batch_tokens,
        evaluate=evaluate,
        console_keys=CONSOLE_KEYS,
    )


def train_sft(cfg: SFTTrainConfig) -> dict[str, Any]:
    """Run ``vlrft train-sft``; returns the run's summary (eval before/after, steps; also summary.json)."""
    with training_run(cfg, "train-sft", preflight_supervised) as run:
        return _train_sft(cfg, run)


def _train_sft(cfg: SFTTrainConfig, run: Run) -> dict[str, Any]:
    strategy = run.strategy
    model, processor = load_model(
        run.initial_model(tool_tokens=cfg.tools.enabled), cfg.model.dtype, trains="model.path"
    )
    use_video_settings(processor, **video_settings(cfg.data))
    tools = ToolBox(cfg.tools, processor_image_kwargs(processor)) if cfg.tools.enabled else None
    try:
        train = sft_records(cfg, processor, tools)
        if not train:
            raise ConfigError(f"data.train_source={cfg.data.train_source!r}: no training conversations")
        prompts = prompt_records(cfg, processor)
        heldout = [_demonstration(r, cfg, tools) for r in prompts if r.answer is not None]
        total = run.total_steps(steps_per_episode(len(train), cfg.train.batch_size, strategy.world_size))
        strategy.prepare(model, total_steps=total)
        task = SFTTask(processor, cfg, strategy.device, tools.schemas if tools is not None else None)

        def evaluate() -> dict[str, float]:
            metrics = heldout_nll(strategy, task, heldout, cfg.train.eval_batch_size) if heldout else {}
            return {**metrics, **greedy_accuracy(strategy, processor, prompts, cfg, tools)}

        trainer = _trainer(run, task, train, evaluate if prompts else None)
        header = f"sft: {len(train)} training conversations, {len(prompts)} held-out prompts, "
        return run.fit(trainer, processor, total, header)
    finally:
        if tools is not None:
            tools.close()


def train_dpo(cfg: DPOTrainConfig) -> dict[str, Any]:
    """Run ``vlrft train-dpo``; returns the run's summary (eval before/after, steps; also summary.json)."""
    with training_run(cfg, "train-dpo", preflight_supervised) as run:
        return _train_dpo(cfg, run)


def _train_dpo(cfg: DPOTrainConfig, run: Run) -> dict[str, Any]:
    strategy = run.strategy
    path = run.initial_model()
    model, processor = load_model(path, cfg.model.dtype, trains="model.path")
    use_video_settings(processor, **video_settings(cfg.data))
    d = cfg.data
    train = preference_pairs(d.train_source, d.synthetic_train_size, cfg.train.seed, cfg, processor)
    if not train:
        raise ConfigError(f"data.train_source={d.train_source!r}: no preference pairs")
    eval_pairs = (
        preference_pairs(d.eval_source, d.synthetic_eval_size, heldout_seed(cfg.train.seed), cfg, processor)
        if d.eval_source
        else []
    )
    prompts = [pair_prompt(p) for p in eval_pairs]
    total = run.total_steps(steps_per_episode(len(train), cfg.train.batch_size, strategy.world_size))
    ref, _, _ = strategy.prepare(load_model(path, cfg.model.dtype)[0], trainable=False)
    strategy.prepare(model, total_steps=total)
    task = DPOTask(processor, cfg, strategy, ref, train + eval_pairs)
    if cfg.dpo.precompute_ref:  # a first pass over every pair (same count on every rank), then free it
        for chunk in _batched(train + eval_pairs, cfg.train.eval_batch_size):
            task.reference(chunk)
        task.ref = None
        del ref

    def evaluate() -> dict[str, float]:
        metrics = heldout_preferences(strategy, task, eval_pairs, cfg.train.eval_batch_size)
        return {**metrics, **greedy_accuracy(strategy, processor, prompts, cfg)}

    trainer = _trainer(run, task, train, evaluate if eval_pairs else None)
    header = f"dpo ({cfg.dpo.loss_type}): {len(train)} train / {len(eval_pairs)} held-out pairs, "
    return run.fit(trainer, processor, total, header)
