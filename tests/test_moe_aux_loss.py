"""The router's load-balancing loss of a mixture-of-experts policy in the update (``algorithm.router_aux_coef``) and
the expert-load metrics (issue 60 item 4): the pure functions against float64 hand computations (gradients included)
and transformers' own ``load_balancing_loss_func``; ``policy_micro_loss`` on the tiny Qwen3-VL-MoE and Qwen3.5-MoE
adds the coefficient times the loss over the response tokens and logs ``moe/*``; a dense policy refuses a
coefficient > 0."""

from __future__ import annotations

import math

import pytest
import torch
from tolerance import assert_within

from data_pipelines.collate import collate_sequences, encode_prompt
from data_pipelines.records import PromptRecord
from vlrft.archs import ARCHS
from vlrft.config import ConfigError, load_config
from vlrft.models.loading import load_model
from vlrft.models.moe import (
    expert_load,
    expert_load_entropy,
    load_balancing_loss,
    max_expert_share,
    moe_blocks,
    router_aux_coef,
)
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.experience import Experience, response_tensors
from vlrft.trainer.micro_losses import policy_micro_loss, update_shares_prompts

MOE = ("qwen3_vl_moe", "qwen3_5_moe")
needs_moe = pytest.mark.skipif(not set(MOE) <= set(ARCHS), reason="transformers without Qwen3.5-MoE / Qwen3-VL-MoE")


def _hand_switch_loss(logits: list[torch.Tensor], experts: list[torch.Tensor], mask: torch.Tensor, e: int):
    """Switch Transformer's eq. 4-6 with top-k, pooled over layers, written out token by token in float64."""
    f = [0.0] * e
    p = [torch.zeros((), dtype=torch.float64) for _ in range(e)]
    rows = 0.0
    for layer_logits, layer_experts in zip(logits, experts):
        probs = torch.softmax(layer_logits, -1)
        for t in range(probs.shape[0]):
            m = float(mask[t])
            rows += m
            for i in layer_experts[t].tolist():
                f[i] += m
            for i in range(e):
                p[i] = p[i] + m * probs[t, i]
    return e * sum(f[i] / rows * p[i] / rows for i in range(e))


def test_load_balancing_loss_is_switch_eq_4_to_6_and_transformers_pooling_with_its_gradient():
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    num_layers, tokens, e, k = 3, 7, 5, 2
    logits = [torch.randn(tokens, e, generator=g, requires_grad=True) for _ in range(num_layers)]
    experts = [torch.topk(torch.softmax(x.detach(), -1), k, -1).indices for x in logits]
    mask = torch.tensor([1, 0, 1, 1, 0, 1, 1])
    got = load_balancing_loss(logits, experts, e, mask)
    got.backward()
    ref_logits = [x.detach().double().requires_grad_() for x in logits]
    ref = _hand_switch_loss(ref_logits, experts, mask, e)
    ref.backward()
    # float32 softmax of 5 O(1) logits and sums of <= 21 terms of O(1): a few ulps (1.2e-7) each, ~1e-6 at worst
    assert_within(abs(got.item() - ref.item()), 1e-5, "switch loss vs float64 hand")
    worst = max(float((x.grad.double() - r.grad).abs().max()) for x, r in zip(logits, ref_logits))
    assert_within(worst, 1e-5, "switch loss gradient vs float64 hand")
    assert all(float(x.grad.abs().max()) > 1e-3 for x in logits)  # the routers get a gradient through P
    # transformers' own function: the same value, with its attention mask and without
    detached = tuple(x.detach() for x in logits)
    theirs = load_balancing_loss_func(detached, e, k, attention_mask=mask[None])
    assert_within(abs(got.item() - theirs.item()), 1e-5, "switch loss vs transformers (masked)")
    unmasked = load_balancing_loss(list(detached), experts, e)
    assert_within(abs(unmasked.item() - load_balancing_loss_func(detached, e, k).item()), 1e-5, "vs transformers")
    # perfect balance: every expert 1/E of the probability and k/E of the slots gives k; no token gives 0
    balanced = load_balancing_loss([torch.zeros(4, 4)], [torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])], 4)
    assert balanced.item() == pytest.approx(2.0, abs=1e-6)
    assert load_balancing_loss(logits, experts, e, torch.zeros(tokens)).item() == 0.0


def test_expert_load_entropy_and_max_share_against_hand_values():
    # layer 0: experts {0,1}, {0,2} counted, {0,1} masked out -> shares 2/4, 1/4, 1/4, 0; layer 1: every expert once
    layer0 = expert_load(torch.tensor([[0, 1], [0, 2], [0, 1]]), 4, torch.tensor([1, 1, 0]))
    layer1 = expert_load(torch.tensor([[0, 1], [2, 3], [3, 0]]), 4, torch.tensor([1, 1, 0]))
    assert layer0.tolist() == [0.5, 0.25, 0.25, 0.0] and layer1.tolist() == [0.25] * 4
    load = torch.stack([layer0, layer1])
    # H_0 = -(1/2 ln 1/2 + 2 * 1/4 ln 1/4) / ln 4 = (3/2 ln 2) / (2 ln 2) = 3/4; H_1 = 1
    assert expert_load_entropy(load).item() == pytest.approx((0.75 + 1.0) / 2, abs=1e-12)
    assert max_expert_share(load).item() == pytest.approx((0.5 + 0.25) / 2, abs=1e-12)
    one = torch.tensor([[1.0, 0.0, 0.0, 0.0]])  # every slot to one expert
    assert expert_load_entropy(one).item() == 0.0 and max_expert_share(one).item() == 1.0
    assert expert_load(torch.tensor([[0, 1]]), 4, torch.tensor([0])).tolist() == [0.0] * 4
    # the normalisation: log E
    assert expert_load_entropy(torch.full((1, 8), 1 / 8, dtype=torch.float64)).item() == pytest.approx(1.0, abs=1e-12)
    assert math.isclose(
        float(expert_load_entropy(torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64))), math.log(2) / math.log(3)
    )


# ---------------------------------------------------------------- the coefficient and the update on tiny models


@needs_moe
def test_router_aux_coef_defaults_to_the_model_config_and_a_dense_model_refuses_one(tiny_model):
    moe, _ = load_model(tiny_model("qwen3_vl_moe"))
    assert moe.config.text_config.router_aux_loss_coef == 0.001
    assert router_aux_coef(moe, None) == 0.001 and router_aux_coef(moe, 0.0) == 0.0 and router_aux_coef(moe, 0.5) == 0.5
    dense, _ = load_model(tiny_model("qwen3_vl"))
    assert router_aux_coef(dense, None) == 0.0 and router_aux_coef(dense, 0.0) == 0.0
    with pytest.raises(ConfigError) as err:
        router_aux_coef(dense, 0.01)
    assert str(err.value) == (
        "algorithm.router_aux_coef=0.01: the policy (qwen3_vl) is not a mixture-of-experts model, it has no router "
        "to balance; leave it unset or 0"
    )
    assert load_config(PolicyTrainConfig, None, []).algorithm.router_aux_coef is None
    with pytest.raises(ConfigError, match="router_aux_coef"):
        load_config(PolicyTrainConfig, None, ["algorithm.router_aux_coef=-0.1"])


def _micro_batch(proc, seed: int = 0):
    """Two prompts, three sampled responses of uneven lengths, old log-probs a little off the current ones."""
    g = torch.Generator().manual_seed(seed)
    recs = [PromptRecord(id="a", prompt="How many apples?"), PromptRecord(id="b", prompt="Which colour is the star?")]
    prompts = [encode_prompt(proc, r) for r in recs]
    responses = [torch.randint(3, 300, (n,), generator=g) for n in (5, 3, 7)]
    index = [0, 1, 1]
    pad = getattr(proc, "tokenizer", proc).pad_token_id
    batch = collate_sequences(prompts, index, responses, pad)
    ids, mask = response_tensors(responses, pad)
    mask[2, 1] = 0  # a token the policy did not sample (a tool observation): out of the loss and the router terms
    adv = torch.tensor([[1.0], [-0.5], [2.0]]).expand(ids.shape).contiguous()
    old = -5.0 + 0.1 * torch.randn(ids.shape, generator=g)
    exp = Experience(batch, ids, mask, old, None, torch.zeros(3), adv, torch.tensor(index))
    return exp.micro_batch(torch.arange(3)), int(mask.sum())


def _response_token_mask(mb) -> torch.Tensor:
    """1 at each sampled response token's own position of the rows [prompt | response | pad]."""
    mask = torch.zeros(mb["input_ids"].shape)
    for i, p in enumerate(mb["prompt_lengths"].tolist()):
        r = mb["response_mask"][i]
        mask[i, p : p + r.numel()] = r.float()[: mask.shape[1] - p]
    return mask


def _algorithm(coef: float | None):
    overrides = [] if coef is None else [f"algorithm.router_aux_coef={coef}"]
    return load_config(PolicyTrainConfig, None, overrides).algorithm


@needs_moe
@pytest.mark.parametrize("arch", MOE)
def test_policy_micro_loss_adds_the_coefficient_times_transformers_loss_over_the_response(arch, tiny_model):
    """loss(c) - loss(0) = c * (the micro-batch's share of the step's tokens) * transformers'
    ``load_balancing_loss_func`` with the response tokens as its mask, gradients of the routers included; the
    ``moe/*`` metrics are the pure functions' values of the forward's routing over the same tokens."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    model, proc = load_model(tiny_model(arch))
    model.eval()  # no dropout: the two passes compute the same forward
    mb, n_tok = _micro_batch(proc)
    global_tokens = 2 * n_tok  # this micro-batch holds half the step's tokens
    run = dict(kl_coef=0.0, temperature=1.0, shared=False, suppress=None)
    routers = [b.gate.weight for b in moe_blocks(model)]
    assert len(routers) == 2

    def loss_and_grads(coef):
        model.zero_grad()
        loss, metrics = policy_micro_loss(model, mb, _algorithm(coef), global_tokens, 3, 7, **run)
        loss.backward()
        return loss.detach(), metrics, [w.grad.clone() for w in routers]

    coef = 0.5
    with_aux, metrics, grads = loss_and_grads(coef)
    without, metrics0, grads0 = loss_and_grads(0.0)

    # the reference: transformers' own function on the router logits transformers returns, masked to the response
    model.zero_grad()
    text = model.config.text_config
    out = model(**{k: mb[k] for k in ("input_ids", "attention_mask")}, output_router_logits=True, use_cache=False)
    tokens = _response_token_mask(mb)
    ref = load_balancing_loss_func(out.router_logits, text.num_experts, text.num_experts_per_tok, tokens)
    (coef * ref * n_tok / global_tokens).backward()
    ref_grads = [w.grad.clone() for w in routers]

    # the aux value is O(k = 2), summed in float32 over ~50 tokens x 4 experts x 2 layers: ~1e-6; the policy loss is
    # the same computation both times (bitwise), so the difference is coef * share * aux to ~1e-7
    assert_within(abs(metrics["moe/aux_loss"] - ref.item()), 1e-5, "moe/aux_loss vs transformers")
    assert_within(abs((with_aux - without).item() - coef * ref.item() * n_tok / global_tokens), 1e-5, "loss(c)-loss(0)")
    # router gradients: O(1e-2); float32 rounding of the two backward passes ~1e-8
    for g1, g0, r in zip(grads, grads0, ref_grads):
        assert float(r.abs().max()) > 1e-4
        assert_within(float((g1 - g0 - r).abs().max()), 1e-6, "router grad of the aux term vs transformers")
    # the metrics: the pure functions over the routing transformers' forward took, on the same tokens
    experts = [torch.topk(torch.softmax(x, -1, dtype=torch.float), 2, -1).indices for x in out.router_logits]
    load = torch.stack([expert_load(x, text.num_experts, tokens.reshape(-1)) for x in experts])
    for m in (metrics, metrics0):
        assert m["moe/expert_load_entropy"] == pytest.approx(float(expert_load_entropy(load)), abs=1e-12)
        assert m["moe/max_expert_share"] == pytest.approx(float(max_expert_share(load)), abs=1e-12)
        assert 0.5 < m["moe/expert_load_entropy"] <= 1.0 and 0.25 <= m["moe/max_expert_share"] < 1.0
    assert metrics0["moe/aux_loss"] == metrics["moe/aux_loss"]
    # the default (null) is the model config's 0.001
    default, _ = policy_micro_loss(model, mb, _algorithm(None), global_tokens, 3, 7, **run)
    assert_within(abs((default - without).item() - 0.001 * ref.item() * n_tok / global_tokens), 1e-7, "default")


@needs_moe
@pytest.mark.parametrize("arch", MOE)
def test_the_router_loss_and_metrics_are_the_same_on_the_group_shared_forward(arch, tiny_model):
    """The router's load-balancing loss and the expert-load metrics are taken over the sampled response tokens on
    every path: the plain rows, Qwen3-VL-MoE's packed row (one row per prompt) and Qwen3.5-MoE's cached path (the
    prompts' forward, whose tokens are not counted, then the continuation of every response token). The group-shared
    forward applies with the router loss on, and the loss and metrics equal the plain path's within the group-shared
    forward's bound (tests/test_group_forward.py: the same float32 sums in another layout), the router loss's gradient
    included (a loss with only the router term)."""
    model, proc = load_model(tiny_model(arch))
    mb, n_tok = _micro_batch(proc)
    assert "prompt_index" in mb
    assert update_shares_prompts(model, mb, _algorithm(None), True)
    assert not update_shares_prompts(model, mb, _algorithm(None), False)
    run = dict(kl_coef=0.0, temperature=1.0, suppress=None)
    got = {}
    for shared in (True, False):
        model.zero_grad()
        loss, metrics = policy_micro_loss(model, mb, _algorithm(10.0), n_tok, 3, 7, shared=shared, **run)
        loss.backward()
        gate = torch.cat([b.gate.weight.grad.flatten() for b in moe_blocks(model)])
        got[shared] = (loss.item(), metrics, gate.clone())
    (ls, ms, gs), (lp, mp, gp) = got[True], got[False]
    print(f"{arch}: aux {ms['moe/aux_loss']:.6f} shared vs {mp['moe/aux_loss']:.6f} plain")
    for key in ("moe/aux_loss", "moe/expert_load_entropy", "moe/max_expert_share"):
        assert_within(abs(ms[key] - mp[key]), 1e-5, f"{arch}: {key}, group-shared vs plain")
    assert_within(abs(ls - lp), 1e-5, f"{arch}: policy loss with the router term (coef 10), group-shared vs plain")
    assert_within(((gs - gp).norm() / gp.norm()).item(), 1e-5, f"{arch}: the routers' gradient, shared vs plain")


def test_a_dense_policy_refuses_a_router_coefficient_in_the_update(tiny_model):
    model, proc = load_model(tiny_model("qwen2"))
    mb, n_tok = _micro_batch(proc)
    run = dict(kl_coef=0.0, temperature=1.0, shared=False, suppress=None)
    with pytest.raises(ConfigError, match=r"^algorithm.router_aux_coef=0.1: the policy \(qwen2\) is not a mixture"):
        policy_micro_loss(model, mb, _algorithm(0.1), n_tok, 3, 7, **run)
    loss, metrics = policy_micro_loss(model, mb, _algorithm(None), n_tok, 3, 7, **run)
    assert torch.isfinite(loss) and not any(k.startswith("moe/") for k in metrics)
