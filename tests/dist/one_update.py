"""One policy update on a fixed global batch, under any strategy; writes the full parameters.

Run alone (single) or under ``torchrun --nproc_per_node=2`` (fsdp2, deepspeed). The samples are fixed
(no generation): each rank builds the experience of its share of the prompts, advantages are computed
on the global batch, losses are aggregated over the global token count. AdamW's eps is 1e-4 (not 1e-8), so
that the update's slope in the gradient is bounded and the comparison is about the strategies, not about a
CPU's float32 rounding (tests/test_policy_distributed.py derives its bound from it).
Usage: python one_update.py MODEL_DIR OUT_FILE STRATEGY [ZERO_STAGE [FORWARD [BUDGET [uneven|even [KEY=VALUE ...]]]]]
FORWARD: shared (the default: each prompt computed once per group) or plain (train.shared_prompt_forward=false).
BUDGET: train.micro_batch_tokens (0: fixed micro-batches of 3). uneven: the odd prompts' last sample is dropped,
so with 2 ranks rank 1 holds 6 samples and rank 0 8 (the micro-batch counts differ unless evened out).
KEY=VALUE: more train-policy overrides (e.g. strategy.compile_blocks=true).
"""

import sys
from dataclasses import replace

import torch

import vlrft.models  # noqa: F401
from data_pipelines.collate import encode_prompt
from data_pipelines.synthetic import make_prompt_records
from reward_models.pool import RewardPool
from vlrft.archs import TEXT_ARCHS
from vlrft.config import load_config
from vlrft.models.cpu_matmul import OneDNNLinear
from vlrft.models.loading import load_model
from vlrft.rollout import Rollout
from vlrft.strategies import finish_process, make_strategy
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.experience import group_rollouts, score_rollouts
from vlrft.trainer.policy_trainer import PolicyTrainer


def main() -> None:
    model_dir, out_file, name = sys.argv[1:4]
    stage = sys.argv[4] if len(sys.argv) > 4 else "2"
    shared = (sys.argv[5] if len(sys.argv) > 5 else "shared") == "shared"
    budget = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    uneven = len(sys.argv) > 7 and sys.argv[7] == "uneven"
    cfg = load_config(PolicyTrainConfig, None, [
        f"strategy.name={name}", f"strategy.zero_stage={stage}", "optim.lr=1e-3", "optim.eps=1e-4", "strategy.grad_clip=0",
        "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "train.micro_train_batch_size=3",
        "train.max_steps=1", "algorithm.loss_agg_mode=token-mean", "train.output_dir=/tmp/unused",
        f"train.shared_prompt_forward={str(shared).lower()}", f"train.micro_batch_tokens={budget}", *sys.argv[8:],
    ])
    strategy = make_strategy(cfg.strategy, cfg.optim)
    torch.manual_seed(0)
    model, proc = load_model(model_dir)
    records = make_prompt_records("color", 4, seed=5)
    if model.config.model_type in TEXT_ARCHS:  # a text model: the same prompts without their images
        records = [replace(r, images=[]) for r in records]
    pool = RewardPool(cfg.reward)
    trainer = PolicyTrainer(cfg, strategy, model, proc, records, pool, accuracy=("accuracy", "vocab_answer"))
    mine = records[strategy.rank :: strategy.world_size]
    tok = getattr(proc, "tokenizer", proc)  # a VL processor's tokenizer, or a text model's own
    rollouts = []
    g = torch.Generator().manual_seed(1)
    for gi, rec in enumerate(records):  # the same global samples whatever the world size
        for j in range(3 if uneven and gi % 2 else 4):
            word = rec.answer if j % 2 == 0 else next(v for v in rec.metadata["vocabulary"] if v != rec.answer)
            tail = torch.randint(0, 900, (j + gi % 3,), generator=g)
            ids = torch.cat([torch.tensor(tok(word)["input_ids"]), tail, torch.tensor([tok.eos_token_id])])
            if rec in mine:
                rollouts.append(Rollout(mine.index(rec), ids, tok.decode(ids, skip_special_tokens=True), "stop"))
    prompts = [encode_prompt(proc, r) for r in mine]
    combined, per_source, _ = score_rollouts(trainer.reward_pool, mine, rollouts, trainer.cfg.tools)
    metrics: dict = {}
    exp = trainer.experience_from(group_rollouts(mine, prompts, rollouts, combined, per_source), metrics)
    calls = []  # forward + backward per micro-batch, padding ones included
    forward = trainer._micro_loss
    trainer._micro_loss = lambda *a: calls.append(1) or forward(*a)
    trainer.train_on(exp, metrics)
    counts = strategy.all_gather_object((len(exp), len(calls)))
    onednn = sum(isinstance(m, OneDNNLinear) for m in strategy.unwrap().modules())  # strategy.cpu_matmul's layers
    state = strategy.full_state_dict()
    if strategy.is_rank0:
        torch.save(
            {"state": state, "metrics": metrics, "samples_and_micro_batches": counts, "onednn_linears": onednn}, out_file
        )
    strategy.barrier()


if __name__ == "__main__":
    main()
    sys.exit(finish_process(0))
