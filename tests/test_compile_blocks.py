"""Compiled transformer blocks (``strategy.compile_blocks``): the policy update they give is the eager blocks' update
(gradients and the parameters after one AdamW step; the group-shared forward's packed attention and the vision tower
included), and a model whose blocks are compiled decodes eagerly and samples the eager model's tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tolerance import assert_within
from torch._dynamo.utils import counters
from updates import max_diff, policy_update

from vlrft.models.loading import load_model
from vlrft.rollout import SamplingParams, make_engine
from vlrft.strategies import OptimConfig, StrategyConfig, make_strategy

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from vllm_sync import make_prompts, trainer_logprobs  # noqa: E402

# The bound of both comparisons, as in tests/test_micro_batch_tokens.py (the same float32 terms, rounded differently):
# a compiled block runs the eager block's float32 operations (its matrix products are the same ATen kernels), with
# the element-wise ones fused into loops that may contract a multiply and an add into one rounding and reduce the
# norms' sums of squares in another order: each such value moves by a rounding step or two (2^-23 relative), and so
# do the gradients built from them, whose largest is below 0.1 here (one ulp 7.5e-9): 1e-6 allows about a hundred
# such steps. AdamW's first step has slope at most lr / eps = 1 in the gradient (lr = eps = 1e-4), so the parameters
# (|theta| <= 1.0001, ulp 1.2e-7) agree within 1e-6 too. Measured: 1.5e-8 (gradients), 7.5e-9 (parameters).
BOUND = 1e-6


def test_compiled_blocks_give_the_update_of_eager_blocks(tiny_model, tmp_path):
    path = tiny_model("qwen2_5_vl")
    grads, params, calls = policy_update(path, tmp_path / "eager", [], critic=False)
    torch._dynamo.reset()
    counters.clear()
    grads_c, params_c, calls_c = policy_update(path, tmp_path / "compiled", ["strategy.compile_blocks=true"], False)
    # something was compiled: the decoder layers' and vision blocks' graphs (split where the eager attention runs)
    assert counters["stats"]["unique_graphs"] >= 4, dict(counters["stats"])
    # the graphs break where the eager attention runs, nowhere else (the vision tower hands its blocks the longest
    # sequence: no host sync inside a block)
    breaks = [k.split("\n")[0] for k in counters["graph_break"]]
    assert all("compiler.disable" in b for b in breaks), breaks
    assert calls == calls_c == 6  # 16 samples of 4 prompts, 3 per micro-batch: packed rows of 1 to 3 responses
    assert max(g.abs().max().item() for g in grads.values()) > 1e-4  # a real gradient
    assert_within(max_diff(grads, grads_c), BOUND, "compiled vs eager blocks: max |gradient difference|")
    assert_within(max_diff(params, params_c), BOUND, "compiled vs eager blocks: max |param difference|")


def saved_for_backward(update):
    """``update()``'s result and the bytes autograd kept for the backward while it ran, outside any checkpoint (each
    storage once): a checkpointed block's saved tensors go to the checkpoint's own hooks, which keep none of them and
    recompute them in the backward, so they are not counted here."""
    seen: set = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = update()
    return out, sum(n for _, n in seen)


def test_compiled_blocks_under_gradient_checkpointing_keep_no_activations_and_give_the_eager_update(
    tiny_model, tmp_path
):
    """``strategy.compile_blocks`` with ``strategy.gradient_checkpointing``: the checkpoint goes around each block's
    compiled forward (transformers >= 5.2x checkpoints inside a layer's forward, where dynamo would trace it as one
    graph, which the eager attention breaks, and then run the whole block eagerly). The blocks compile, keep none of
    their activations for the backward (its recompute runs the compiled forward again), and the update is the eager
    blocks' (the same bound as above)."""
    path = tiny_model("qwen2_5_vl")
    (grads, params, _), eager_kept = saved_for_backward(
        lambda: policy_update(path, tmp_path / "eager", [], critic=False)
    )
    torch._dynamo.reset()
    compiled = ["strategy.compile_blocks=true"]
    (_, _, _), compiled_kept = saved_for_backward(lambda: policy_update(path, tmp_path / "c", compiled, False))
    torch._dynamo.reset()
    counters.clear()
    both = [*compiled, "strategy.gradient_checkpointing=true"]
    (grads_c, params_c, _), kept = saved_for_backward(lambda: policy_update(path, tmp_path / "ckpt", both, False))
    assert counters["stats"]["unique_graphs"] >= 4, dict(counters["stats"])  # the blocks compiled, checkpointed
    # measured: 8.1 MiB kept by the eager blocks' update, 6.9 MiB by the compiled blocks', 2.3 MiB by the compiled
    # and checkpointed blocks' (what is left: the embeddings, the LM head, the loss and the tiny model's weights)
    assert compiled_kept < eager_kept
    assert kept < 0.5 * compiled_kept, (kept, compiled_kept)
    assert_within(max_diff(grads, grads_c), BOUND, "compiled + checkpointed vs eager blocks: max |gradient difference|")
    assert_within(max_diff(params, params_c), BOUND, "compiled + checkpointed vs eager blocks: max |param difference|")


def test_a_model_with_compiled_blocks_decodes_eagerly_and_samples_the_eager_tokens(tiny_model):
    """The hf engine generates with the training module on one CPU process: its decoder layers, called with a KV
    cache, run their eager forward (the prefill's vision blocks run compiled), so greedy and seeded sampled tokens
    are the eager model's; the trainer's log-probs of them (no cache: compiled) are the eager model's too."""
    path = tiny_model("qwen2_5_vl")
    runs = {}
    for compiled in (False, True):
        strategy = make_strategy(StrategyConfig(name="single", compile_blocks=compiled), OptimConfig())
        model, processor = load_model(path, "float32")
        strategy.prepare(model, total_steps=1)
        model.eval()
        engine = make_engine("hf", model, processor)
        assert engine.copy is None  # one CPU process: the engine decodes with the (compiled) training module
        prompts = make_prompts(processor, "one_image", seed=3)
        greedy = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=8))
        torch.manual_seed(5)
        sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8))
        with torch.no_grad():
            logprobs, mask = trainer_logprobs(model, processor, prompts, sampled, 1.0, suppress=engine.suppress)
        runs[compiled] = (greedy, sampled, logprobs, mask)
    (greedy, sampled, logprobs, mask), (greedy_c, sampled_c, logprobs_c, _) = runs[False], runs[True]
    assert [r.response_ids.tolist() for r in greedy] == [r.response_ids.tolist() for r in greedy_c]
    assert [r.response_ids.tolist() for r in sampled] == [r.response_ids.tolist() for r in sampled_c]
    assert sum(len(r.response_ids) for r in sampled) >= 8 * 4  # 8 samples, most of 8 tokens
    gap = float((logprobs - logprobs_c).abs()[mask.bool()].max())
    # log-probs of about -7 from logits through two compiled blocks: a few float32 rounding steps (5e-7 each)
    assert_within(gap, 1e-5, "compiled vs eager blocks: log-probs of the sampled tokens")
