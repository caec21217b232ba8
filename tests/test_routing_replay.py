"""Rollout routing replay (R3, arXiv 2510.11370; issue 60 item 5) on the tiny Qwen3-VL-MoE and Qwen3.5-MoE: recording
gives the experts the model's own routing picks (a plain forward, and the hf engine's prefill-once generate);
replaying them reproduces the forward bitwise; after the router moved, the replayed forward still uses the recorded
experts and its router gradient is the float64 gradient of the replayed gating; and replaying a bf16 rollout's routing
in the float32 training forward makes the expert choices identical and shrinks the rollout-vs-trainer log-prob gap."""

from __future__ import annotations

import copy

import pytest
import torch
from PIL import Image
from tolerance import assert_within
from transformers.activations import ACT2FN

from data_pipelines.collate import collate_prompts, collate_sequences, encode_prompt
from data_pipelines.records import PromptRecord
from vlrft.archs import ARCHS
from vlrft.models.loading import load_model
from vlrft.models.moe import moe_blocks
from vlrft.models.routing_replay import NOT_RECORDED, record_routing, replay_routing, sequence_routing
from vlrft.rollout import SamplingParams, make_engine
from vlrft.rollout.base import stack_rollout_logprobs
from vlrft.trainer.experience import response_logprobs, response_tensors

MOE = ("qwen3_vl_moe", "qwen3_5_moe")
pytestmark = pytest.mark.skipif(
    not set(MOE) <= set(ARCHS), reason="transformers without Qwen3.5-MoE / Qwen3-VL-MoE (5.24 has them)"
)


def _image(seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (64, 96, 3), generator=g, dtype=torch.uint8).numpy())


def _prompts(proc, count: int = 4) -> list:
    words = ["apples", "books", "circles", "students", "stars", "pages"]
    recs = [PromptRecord(id="img", prompt="<image> what colour?", images=[_image(1)])]
    recs += [PromptRecord(id=str(i), prompt=f"How many {w} are there?") for i, w in enumerate(words[: count - 1])]
    return [encode_prompt(proc, r) for r in recs]


def _inputs(batch: dict) -> dict:
    keys = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw")
    return {k: batch[k] for k in keys if k in batch}


def _routing_of(model, inputs: dict) -> torch.Tensor:
    """The experts ``[B, S, L, k]`` transformers' own forward picks: top-k of its returned router logits."""
    out = model(**inputs, output_router_logits=True, use_cache=False)
    b, s = inputs["input_ids"].shape
    k = model.config.text_config.num_experts_per_tok
    picks = [torch.topk(torch.softmax(x, -1, dtype=torch.float), k, -1).indices for x in out.router_logits]
    return torch.stack([p.reshape(b, s, k) for p in picks], dim=2)


@pytest.mark.parametrize("arch", MOE)
def test_recording_gives_the_experts_the_models_own_routing_picks(arch, tiny_model):
    """A plain forward over left-padded prompts (an image prompt among them), and the hf engine generating two
    samples per prompt with the prompt prefilled once (a forward over the prompts, then over their samples: the
    record expands the first to the second): each sample's recorded experts at positions [prompt | response but its
    last token] are those of the sample's own plain forward; its last token, which no rollout forward saw, holds
    NOT_RECORDED."""
    model, proc = load_model(tiny_model(arch))
    model.eval()
    prompts = _prompts(proc)
    batch = collate_prompts(prompts, proc.tokenizer.pad_token_id)
    with torch.no_grad():
        with record_routing(model) as record:
            model(**_inputs(batch), use_cache=False)
        recorded = record.take()
        assert recorded.shape == (*batch["input_ids"].shape, 2, 2) and recorded.dtype == torch.int16
        assert torch.equal(recorded.long(), _routing_of(model, _inputs(batch)))
        assert record.take().numel() == 0  # taken

        engine = make_engine("hf", model, proc)
        assert engine.prefill_once
        with record_routing(model) as record:
            rollouts = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=6))
        recorded = record.take()
    width = batch["input_ids"].shape[1]
    steps = max(x.response_ids.numel() for x in rollouts)
    assert recorded.shape == (len(rollouts), width + steps - 1, 2, 2)
    lengths = [prompts[x.prompt_index].input_ids.numel() for x in rollouts]
    per_sample = sequence_routing(recorded, width, lengths, [x.response_ids.numel() for x in rollouts])
    for x, seq, p in zip(rollouts, per_sample, lengths):
        alone = collate_sequences(prompts, [x.prompt_index], [x.response_ids], proc.tokenizer.pad_token_id)
        with torch.no_grad():
            own = _routing_of(model, _inputs(alone))[0]  # [prompt + response, L, k]
        assert seq.shape == own.shape
        assert torch.equal(seq[:-1].long(), own[:-1]) and bool((seq[-1] == NOT_RECORDED).all())


@pytest.mark.parametrize("arch", MOE)
def test_replaying_the_recorded_experts_reproduces_the_forward_bitwise(arch, tiny_model):
    model, proc = load_model(tiny_model(arch))
    batch = collate_prompts(_prompts(proc), proc.tokenizer.pad_token_id)
    inputs = _inputs(batch)
    with torch.no_grad():
        with record_routing(model) as record:
            plain = model(**inputs, use_cache=False).logits
        recorded = record.take()
        with replay_routing(model, recorded):
            replayed = model(**inputs, use_cache=False).logits
        # NOT_RECORDED everywhere: the router routes every token itself
        with replay_routing(model, torch.full_like(recorded, NOT_RECORDED)):
            free = model(**inputs, use_cache=False).logits
    assert torch.equal(replayed, plain) and torch.equal(free, plain)
    with pytest.raises(ValueError, match=r"replay_routing: experts of shape \(4, 3, 2, 2\) for a forward over"):
        with replay_routing(model, recorded[:, :3]):
            model(**inputs, use_cache=False)
    with pytest.raises(ValueError, match=r"not \[B, S, 2, top_k\]"):
        with replay_routing(model, recorded[:, :, :1]):
            pass


def _block_float64(block, x: torch.Tensor, experts: torch.Tensor, act: str):
    """The replayed MoE block by hand in float64: softmax of x W^T, taken at the given experts and renormalised, as
    the weights of those experts' SwiGLU outputs (Qwen3.5-MoE: plus its sigmoid-gated shared expert); the router
    weight W a float64 leaf for its gradient."""
    f = ACT2FN[act]
    w = block.gate.weight.detach().double().requires_grad_()
    x = x.double().reshape(-1, x.shape[-1])
    probs = torch.softmax(x @ w.T, -1)
    top = probs.gather(-1, experts)
    weights = top / top.sum(-1, keepdim=True)
    gate_up, down = block.experts.gate_up_proj.detach().double(), block.experts.down_proj.detach().double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(experts[t].tolist()):
            g, u = (gate_up[e] @ x[t]).chunk(2)
            out[t] = out[t] + weights[t, j] * (down[e] @ (f(g) * u))
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        mlp = {k: v.detach().double() for k, v in shared.state_dict().items()}
        s = (f(x @ mlp["gate_proj.weight"].T) * (x @ mlp["up_proj.weight"].T)) @ mlp["down_proj.weight"].T
        out = out + torch.sigmoid(x @ block.shared_expert_gate.weight.detach().double().T) * s
    return out, w


@pytest.mark.parametrize("arch", MOE)
def test_replay_keeps_the_recorded_experts_after_the_router_moved_and_its_gradient_is_the_gatings(arch, tiny_model):
    """One MoE block: record its routing of 16 tokens, move the router (some tokens' top-2 change: an optimizer step
    of the router), replay. The replayed forward uses the recorded experts; its output and the router weight's
    gradient are the float64 hand computation of the replayed gating."""
    model, _ = load_model(tiny_model(arch))
    block = moe_blocks(model)[0]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 16, block.gate.hidden_dim, generator=g)
    with torch.no_grad(), record_routing(block) as record:
        block(x)
    old = record.take()  # [1, 16, 1, 2]
    with torch.no_grad():
        block.gate.weight.add_(0.05 * torch.randn(block.gate.weight.shape, generator=g))
        with record_routing(block) as record:
            block(x)
    moved = record.take()
    changed = (old.sort(-1).values != moved.sort(-1).values).any(-1).sum().item()
    assert 0 < changed < 16, changed

    upstream = torch.randn(x.shape, generator=g)
    block.zero_grad()
    with replay_routing(block, old), record_routing(block) as record:
        y = block(x)
        (y * upstream).sum().backward()
    assert torch.equal(record.take(), old)  # the experts the replayed forward used
    grad = block.gate.weight.grad
    ref, w64 = _block_float64(block, x, old[0, :, 0].long(), model.config.text_config.hidden_act)
    (ref * upstream.double().reshape(ref.shape)).sum().backward()
    assert float(grad.abs().max()) > 1e-3  # the router learns under replay
    # float32 vs float64: dot products of 64 O(1) terms and a 4-way softmax, a few ulps (6e-8 relative) each along
    # the way; outputs and gradients are O(1e-1)-O(1): ~1e-6 at worst
    assert_within(
        float((y.detach().double().reshape(ref.shape) - ref.detach()).abs().max()), 1e-5, "replayed block vs float64"
    )
    assert_within(float((grad.double() - w64.grad).abs().max()), 1e-5, "router gradient vs float64")


@pytest.mark.parametrize("arch", MOE)
def test_replaying_a_bf16_rollouts_routing_closes_the_logprob_gap_of_flipped_experts(arch, tiny_model):
    """The engine and the trainer compute the same weights in different numerics (here the hf engine on a bfloat16
    copy, the trainer in float32), so near ties between router logits go different ways. Replaying the engine's
    recorded routing in the trainer's forward (``response_logprobs``, the plain rows) makes every expert choice
    identical and shrinks the largest log-prob gap to the bf16 rounding of the rest of the forward. The random
    experts are scaled up 8x: at initialisation an expert's output is small next to the residual stream, so which
    expert a token reached would barely move its log-prob, unlike in a trained MoE. The figures are those of this
    seed's 24 samples under the suite's pinned CPU arithmetic (tests/conftest.py): a flip reaches a response log-prob
    only through a later layer or at a position that predicts a response token, so on other samples the no-replay gap
    can be as small as the replayed one."""
    model, proc = load_model(tiny_model(arch))
    model.eval()
    with torch.no_grad():
        for block in moe_blocks(model):
            block.experts.down_proj.mul_(8.0)
    rollout_model = copy.deepcopy(model).to(torch.bfloat16)
    prompts = _prompts(proc, 6)
    engine = make_engine("hf", rollout_model, proc)
    torch.manual_seed(0)
    with torch.no_grad(), record_routing(rollout_model) as record:
        rollouts = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=16, logprobs=True))
    recorded = record.take()
    pad = proc.tokenizer.pad_token_id
    width = collate_prompts(prompts, pad)["input_ids"].shape[1]
    index = [x.prompt_index for x in rollouts]
    prompt_lengths = [prompts[i].input_ids.numel() for i in index]
    per_sample = sequence_routing(recorded, width, prompt_lengths, [x.response_ids.numel() for x in rollouts])
    batch = collate_sequences(prompts, index, [x.response_ids for x in rollouts], pad)
    ids, mask = response_tensors([x.response_ids for x in rollouts], pad)
    engine_logp = stack_rollout_logprobs(rollouts, ids.shape[1])
    replay = torch.full((*batch["input_ids"].shape, *recorded.shape[2:]), NOT_RECORDED, dtype=recorded.dtype)
    for i, seq in enumerate(per_sample):
        replay[i, : seq.shape[0]] = seq
    seen = replay[..., 0, 0] != NOT_RECORDED
    suppress = torch.tensor(engine.suppress)

    with torch.no_grad():
        with record_routing(model) as trainer_routing:
            plain, _ = response_logprobs(model, batch, ids, suppress=suppress)
        with replay_routing(model, replay), record_routing(model) as used:
            replayed, _ = response_logprobs(model, batch, ids, suppress=suppress)
    own, used = trainer_routing.take(), used.take()
    flips = int((own.sort(-1).values != replay.sort(-1).values).any(-1)[seen].sum())
    assert flips > 0  # without replay some (position, layer) went to other experts than in the rollout
    assert torch.equal(used[seen], replay[seen])  # with replay every one went to the rollout's
    on = mask.bool()
    gap_plain, gap_replay = (plain - engine_logp).abs()[on], (replayed - engine_logp).abs()[on]
    print(
        f"\n{arch}: {flips} of {int(seen.sum()) * 2} routings flipped; |trainer - rollout| log-prob gap over "
        f"{int(on.sum())} tokens: max {gap_plain.max():.4g} without replay, {gap_replay.max():.4g} with; mean "
        f"{gap_plain.mean():.3g} without, {gap_replay.mean():.3g} with"
    )
    assert gap_replay.max() < gap_plain.max() / 3 and gap_replay.mean() < gap_plain.mean()  # measured: 10-19x
