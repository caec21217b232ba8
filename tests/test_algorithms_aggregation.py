"""Loss aggregation modes over unequal lengths and gradient accumulation; global token counts (gloo)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlrft.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss, global_sequence_count, global_token_count
from vlrft.algorithms.policy_losses import compute_policy_loss

F64 = torch.float64
# 4 responses of lengths 3, 1, 0 (zero-length) and 2 in a [4, 3] batch
LOSS = torch.tensor([[1.0, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]], dtype=F64)
MASK = torch.arange(3)[None] < torch.tensor([[3], [1], [0], [2]])
EXPECTED = {
    "token-mean": (1 + 2 + 3 + 4 + 10 + 11) / 6,  # 31/6 over the 6 response tokens
    "seq-mean-token-mean": ((1 + 2 + 3) / 3 + 4 / 1 + (10 + 11) / 2) / 3,  # 5.5 over 3 non-empty responses
    "seq-mean-token-sum": (6 + 4 + 21) / 3,  # 31/3
    "seq-mean-token-sum-norm": (6 + 4 + 21) / 4 / 3,  # constant L_max = 4: 31/12
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_documented_values_on_unequal_lengths(mode):
    assert aggregate_loss(LOSS, MASK, mode, max_response_length=4).item() == pytest.approx(EXPECTED[mode], abs=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_two_accumulation_steps_give_the_big_batch_loss_and_gradient(mode):
    weight = torch.tensor(1.0, dtype=F64, requires_grad=True)
    scale = torch.linspace(0.5, 2.0, 12, dtype=F64).reshape(4, 3)

    def loss_of(rows, **counts):
        return aggregate_loss(weight * scale[rows] * LOSS[rows], MASK[rows], mode, max_response_length=4, **counts)

    big = loss_of(slice(0, 4))
    (g_big,) = torch.autograd.grad(big, weight)
    steps = [slice(0, 2), slice(2, 4)]  # step 1: lengths 3, 1 ; step 2: lengths 0, 2
    n_tok = global_token_count([MASK[s] for s in steps])
    n_seq = global_sequence_count([MASK[s] for s in steps])
    assert (n_tok, n_seq) == (6, 3)
    accumulated = sum(loss_of(s, global_token_count=n_tok, num_sequences=n_seq) for s in steps)
    (g_acc,) = torch.autograd.grad(accumulated, weight)
    assert accumulated.item() == pytest.approx(big.item(), abs=1e-12)
    assert g_acc.item() == pytest.approx(g_big.item(), abs=1e-12)


def test_per_micro_batch_counts_would_be_wrong():
    """Why global counts: averaging per-micro-batch token means weights the short step's tokens more."""
    steps = [slice(0, 2), slice(2, 4)]
    local = sum(aggregate_loss(LOSS[s], MASK[s], "token-mean") for s in steps) / 2
    assert local.item() == pytest.approx(((1 + 2 + 3 + 4) / 4 + (10 + 11) / 2) / 2)  # 6.5
    assert local.item() != pytest.approx(EXPECTED["token-mean"])


def test_policy_loss_token_mean_accumulates_to_one_big_batch_gradient():
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(4, 3, generator=g, dtype=F64) * 0.3).requires_grad_()
    old = torch.randn(4, 3, generator=g, dtype=F64) * 0.3
    adv = torch.randn(4, 3, generator=g, dtype=F64)
    big, _ = compute_policy_loss("ppo", logp, old, adv, MASK, clip_high=0.28)
    (g_big,) = torch.autograd.grad(big, logp)
    n_tok = global_token_count([MASK[:2], MASK[2:]])
    acc = sum(
        compute_policy_loss("ppo", logp[s], old[s], adv[s], MASK[s], clip_high=0.28, global_token_count=n_tok)[0]
        for s in (slice(0, 2), slice(2, 4))
    )
    (g_acc,) = torch.autograd.grad(acc, logp)
    assert acc.item() == pytest.approx(big.item(), abs=1e-12)
    torch.testing.assert_close(g_acc, g_big)


def test_empty_batch_and_bad_arguments():
    zero = aggregate_loss(LOSS.clone().requires_grad_(), torch.zeros_like(MASK), "seq-mean-token-mean")
    assert zero.item() == 0
    zero.backward()  # still attached to the graph
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        aggregate_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="shape"):
        aggregate_loss(LOSS, MASK[:, :2], "token-mean")
    with pytest.raises(ValueError, match="max_response_length > 0"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", max_response_length=0)
    with pytest.raises(ValueError, match="got no masks"):
        global_token_count([])


def _rank_main(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # rank 0 holds responses 0-1 (two micro-batches), rank 1 holds responses 2-3 (one micro-batch)
        micro = [MASK[0:1], MASK[1:2]] if rank == 0 else [MASK[2:4]]
        n_tok = global_token_count(micro)
        n_seq = global_sequence_count(micro)
        weight = torch.tensor(1.0, dtype=F64, requires_grad=True)
        rows = [slice(0, 1), slice(1, 2)] if rank == 0 else [slice(2, 4)]
        loss = sum(aggregate_loss(weight * LOSS[r], MASK[r], "token-mean", global_token_count=n_tok) for r in rows)
        loss.backward()
        grad = weight.grad.clone()
        dist.all_reduce(grad)  # what DDP/FSDP would do, as a sum
        torch.save({"n_tok": n_tok, "n_seq": n_seq, "grad": grad.item()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_global_token_count_over_two_gloo_ranks(tmp_path):
    mp.spawn(_rank_main, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    weight = torch.tensor(1.0, dtype=F64, requires_grad=True)
    aggregate_loss(weight * LOSS, MASK, "token-mean").backward()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert (got["n_tok"], got["n_seq"]) == (6, 3)
        assert got["grad"] == pytest.approx(weight.grad.item(), abs=1e-12)  # = 31/6: same as one big batch
