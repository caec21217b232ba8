"""The group-shared forward (vlrft/models/group_forward.py) equals the plain per-sample path: per-token
log-probs, entropies, critic values and gradients, on mixed batches; and it really computes each prompt
(and its vision tower) once per group."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from tolerance import assert_within
from updates import loss_gradients

from data_pipelines.collate import collate_sequences, encode_prompt
from data_pipelines.records import PromptRecord
from reward_models.scalar import ScalarRewardModel
from vlrft.archs import TEXT_ARCHS
from vlrft.models.attention_functions import VARLEN_SDPA
from vlrft.models.loading import load_model, load_processor
from vlrft.models.packed_attention import _explicit_scores
from vlrft.models.packing import pack_groups, sample_images, shared_forward_applies
from vlrft.rollout import SamplingParams, make_engine
from vlrft.trainer.experience import Experience, infer_response_logprobs, response_logprobs, response_tensors

# The bound of every comparison here: both paths compute the same float32 sums in another order (other
# sequence layouts, attention over packed rows). A log-prob or a value of the tiny model is a sum over ~1e3 logits
# and 2 layers of 64-wide dot products of O(1) terms: each reordered sum is off by a few ulps (1.2e-7 at 1), and
# the ~10 sums along the path add up to ~1e-6 at worst. 1e-5 is ten times that; the measured values sit near 1e-7.
FORWARD_BOUND = 1e-5


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _records(with_images: bool) -> list[PromptRecord]:
    if not with_images:  # a text-only model: three text prompts of different lengths
        texts = ["what colour?", "A text-only prompt that is a little longer than the others.", "same or not?"]
        return [PromptRecord(id=str(i), prompt=t) for i, t in enumerate(texts)]
    recs = [
        PromptRecord(id="one", prompt="<image> what colour?", images=[_image(1, (56, 84))]),
        PromptRecord(id="text", prompt="A text-only prompt that is a little longer than the others."),
        PromptRecord(id="two", prompt="<image> and <image>: same?", images=[_image(2, (56, 56)), _image(3, (112, 56))]),
    ]
    if with_images:
        three = [_image(4, (56, 56)), _image(5, (84, 56)), _image(6, (56, 112))]
        recs.append(PromptRecord(id="three", prompt="<image><image><image> count", images=three))
    return recs


def _batch(proc, recs, group_sizes, seed=0, lengths=None):
    """Groups of ``group_sizes`` random responses of uneven lengths (1 to 9 tokens, or ``lengths[prompt]``) per
    prompt."""
    g = torch.Generator().manual_seed(seed)
    prompts = [encode_prompt(proc, r) for r in recs]
    index, responses = [], []
    for p, n in enumerate(group_sizes):
        for k in range(n):
            length = lengths[p][k] if lengths else int(torch.randint(1, 10, (1,), generator=g))
            responses.append(torch.randint(3, 200, (length,), generator=g))
            index.append(p)
    pad = proc.tokenizer.pad_token_id if hasattr(proc, "tokenizer") else proc.pad_token_id
    batch = collate_sequences(prompts, index, responses, pad)
    ids, mask = response_tensors(responses, pad)
    return batch, ids, mask


def _both(model, batch, ids, **kw):
    shared = response_logprobs(model, batch, ids, with_entropy=True, shared=True, **kw)
    plain = response_logprobs(model, batch, ids, with_entropy=True, shared=False, **kw)
    return shared, plain


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen2", "qwen3"])
def test_shared_logprobs_and_entropies_equal_unshared(arch, tiny_model):
    model, proc = load_model(tiny_model(arch), torch.float32)
    model.eval()
    recs = _records(with_images=arch not in TEXT_ARCHS)
    sizes = [3, 1, 16, 2][: len(recs)]
    batch, ids, mask = _batch(proc, recs, sizes)
    with torch.no_grad():
        (lp_s, ent_s), (lp_p, ent_p) = _both(model, batch, ids, temperature=0.7)
    m = mask.bool()
    dlp = (lp_s - lp_p)[m].abs().max().item()
    dent = (ent_s - ent_p)[m].abs().max().item()
    print(f"{arch}: max |dlogp| {dlp:.2e}, max |dentropy| {dent:.2e} over {int(m.sum())} tokens")
    assert_within(dlp, FORWARD_BOUND, f"{arch}: shared vs plain log-probs")
    assert_within(dent, FORWARD_BOUND, f"{arch}: shared vs plain entropies")
    assert lp_s.shape == ids.shape and torch.isfinite(lp_s[m]).all()


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3"])
def test_gradients_equal_unshared_for_every_parameter(arch, tiny_model):
    """The policy loss's gradient wrt every parameter, vision tower included, within 1e-5 relative (text Qwen3:
    its q/k norms too)."""
    model, proc = load_model(tiny_model(arch), torch.float32)
    model.train()
    vision = arch not in TEXT_ARCHS
    recs = _records(vision)
    batch, ids, mask = _batch(proc, recs, [2, 3, 5, 1][: len(recs)], seed=1)
    adv = torch.randn(ids.shape[0], 1).expand_as(ids)

    gs, gp = (loss_gradients(model, batch, ids, mask, adv, shared=x, entropy_coef=0.01) for x in (True, False))
    assert set(gs) == set(gp) and any(k.startswith("model.visual") for k in gs) == vision
    worst = max(((gs[k] - gp[k]).norm() / gp[k].norm().clamp_min(1e-12)).item() for k in gp if gp[k].norm() > 0)
    print(f"{len(gp)} parameters, worst relative gradient difference {worst:.2e}")
    # gradients are sums of those (float32-rounded) per-token terms over the batch: the same ~1e-6 relative
    assert_within(worst, FORWARD_BOUND, "shared vs plain gradients, worst relative difference over parameters")


def test_vision_tower_runs_once_per_unique_prompt(tiny_model):
    """Counted with a forward hook on the real vision tower: image patches encoded, shared vs per sample."""
    model, proc = load_model(tiny_model("qwen2_5_vl"), torch.float32)
    model.eval()
    recs = _records(True)
    sizes = [4, 2, 8, 3]
    batch, ids, _ = _batch(proc, recs, sizes)
    seen: list[int] = []
    handle = model.model.visual.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            response_logprobs(model, batch, ids, shared=True)
            response_logprobs(model, batch, ids, shared=False)
    finally:
        handle.remove()
    firsts = [batch["prompt_index"].tolist().index(p) for p in range(len(recs))]
    once = sample_images(batch, firsts)
    assert once["image_grid_thw"].shape[0] == sum(len(r.images) for r in recs)  # 6 images, 34 in the batch
    assert seen == [once["pixel_values"].shape[0], batch["pixel_values"].shape[0]]  # image patches encoded
    packed = pack_groups(model, batch, ids.shape[1], torch.device("cpu"))
    assert packed.inputs["input_ids"].shape[0] == len(recs)  # one row per prompt
    assert packed.inputs["input_ids"].numel() < batch["input_ids"].numel() / 2.5  # 340 vs 1003 token slots


def test_split_group_across_micro_batches_equals_unshared(tiny_model):
    """A group of 16 split into micro-batches of 5 (the prompt recomputed per chunk), through the
    experience's own micro-batch selection, gives the plain path's log-probs."""
    model, proc = load_model(tiny_model("qwen2_5_vl"), torch.float32)
    batch, ids, mask = _batch(proc, _records(True)[:2], [16, 3], seed=2)
    shared = infer_response_logprobs(model, batch, ids, micro_batch_size=5, shared=True)
    plain = infer_response_logprobs(model, batch, ids, micro_batch_size=19, shared=False)
    assert_within((shared - plain)[mask.bool()].abs().max(), FORWARD_BOUND, "group split in micro-batches: log-probs")
    exp = Experience(batch, ids, mask, None, None, torch.zeros(19), torch.zeros(ids.shape), batch["prompt_index"])
    sub = exp.micro_batch(torch.tensor([17, 3, 18, 4]))  # samples of two prompts, interleaved
    assert sub["prompt_index"].tolist() == [1, 0, 1, 0]
    with torch.no_grad():
        got, _ = response_logprobs(model, sub, sub["response_ids"], shared=True)
    want = plain[[17, 3, 18, 4], : got.shape[1]]
    assert_within((got - want)[sub["response_mask"].bool()].abs().max(), FORWARD_BOUND, "interleaved micro-batch")


def test_empty_responses_pack_as_the_plain_path_reads_them(tiny_model):
    """Responses without a token (an engine may return one) in a packed micro-batch: among others they read
    nothing and the rest equal the plain path; a micro-batch where every response is empty gives ``[N, 0]`` as the
    plain path does (it was an arange(-1) error)."""
    model, proc = load_model(tiny_model("qwen2_5_vl"), torch.float32)
    model.eval()
    recs = _records(True)[:2]
    for lengths in ([[0, 3, 0], [2, 0]], [[0, 0, 0], [0, 0]]):
        batch, ids, mask = _batch(proc, recs, [3, 2], lengths=lengths)
        width = max(max(x) for x in lengths)  # a micro-batch's responses are cut to its longest (Experience)
        ids, mask = ids[:, :width], mask[:, :width]
        with torch.no_grad():
            (shared, _), (plain, _) = _both(model, batch, ids)
        assert shared.shape == plain.shape == (5, width)
        if mask.any():
            assert_within((shared - plain)[mask.bool()].abs().max(), FORWARD_BOUND, "empty responses: log-probs")


def test_critic_values_equal_unshared(tiny_model):
    from vlrft.trainer.experience import response_values

    path = tiny_model("qwen2_5_vl")
    critic = ScalarRewardModel.from_backbone(path).eval()
    proc = load_processor(path)
    batch, ids, mask = _batch(proc, _records(True), [3, 2, 4, 1], seed=3)
    with torch.no_grad():
        shared = response_values(critic, batch, ids.shape[1], shared=True)
        plain = response_values(critic, batch, ids.shape[1], shared=False)
    assert_within((shared - plain)[mask.bool()].abs().max(), FORWARD_BOUND, "shared vs plain critic values")


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen2", "qwen3"])
def test_engine_prefills_each_prompt_once_and_samples_as_the_plain_path(arch, tiny_model):
    """The hf engine's ``prefill_once`` (one prefill per prompt, its KV cache held once for the n samples:
    SharedPrefixLayer, attended by packed_sdpa) gives the plain repeated-prompt path's tokens, greedy and seeded
    sampling alike; the vision tower encodes each prompt's images once."""
    model, proc = load_model(tiny_model(arch), torch.float32)
    recs = _records(with_images=arch not in TEXT_ARCHS)
    prompts = [encode_prompt(proc, r) for r in recs]
    engine = make_engine("hf", model, proc)
    assert engine.prefill_once
    seen: list[int] = []
    visual = getattr(getattr(model, "model", None), "visual", None)
    if visual is not None:
        visual.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
    results = {}
    for once in (True, False):
        engine.prefill_once = once
        greedy = engine.generate(prompts, SamplingParams(n=3, temperature=0, max_new_tokens=8))
        torch.manual_seed(7)
        sampled = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=8))
        results[once] = [[x.response_ids.tolist() for x in out] for out in (greedy, sampled)]
    assert results[True] == results[False]
    assert model.config.get_text_config()._attn_implementation == "vlrft_packed_sdpa"
    if visual is not None:
        patches = sum(int(p.image_grid_thw.prod(-1).sum()) for p in prompts if p.image_grid_thw is not None)
        assert seen == [patches, patches, 3 * patches, 3 * patches]  # prefill once vs per sample


def test_shared_forward_applies_only_with_prompt_index_and_a_block_mask_kernel(tiny_model):
    model, proc = load_model(tiny_model("qwen2_5_vl"), torch.float32)
    batch, _, _ = _batch(proc, _records(True)[:2], [2, 1])
    assert shared_forward_applies(model, batch)
    assert not shared_forward_applies(model, {k: v for k, v in batch.items() if k != "prompt_index"})
    model.config._attn_implementation = "flash_attention_2"  # takes no 4-D mask: the plain rows are used
    try:
        assert not shared_forward_applies(model, batch)
    finally:
        model.config._attn_implementation = "sdpa"


def test_packed_attention_computes_from_the_layout_and_equals_the_dense_block_mask(tiny_model):
    """``packed_sdpa`` (the text layers' attention once a model is packed) computes each packed row from its layout,
    not from the dense block mask: with the mask replaced by one that allows every pair, the outputs stay the
    block-masked ones; and they equal SDPA under the dense block mask (the layout dropped), gradients included.
    Both ways of computing a block's responses are among the blocks: the explicit scores (responses no longer than
    the head dimension, 16 here) and SDPA over copies of the prompt's keys (the text prompt's 20-token response)."""
    model, proc = load_model(tiny_model("qwen2_5_vl"), torch.float32)
    model.train()
    recs = _records(True)
    # a fifth prompt of the first one's shape (its image another colour): with 3 responses of the same longest
    # length, the two rows form one block, computed together
    recs.append(PromptRecord(id="one'", prompt="<image> what colour?", images=[_image(7, (56, 84))]))
    response_lengths = [[2, 6, 4], [20], [1, 9, 3, 2, 7, 4], [3, 8], [6, 1, 5]]
    batch, ids, _ = _batch(proc, recs, [3, 1, 6, 2, 3], seed=4, lengths=response_lengths)
    packed = pack_groups(model, batch, ids.shape[1], torch.device("cpu"))
    assert model.config.text_config._attn_implementation == "vlrft_packed_sdpa"
    assert model.config.vision_config._attn_implementation == "sdpa"  # the vision attention has its own (varlen)
    layout = packed.inputs["vlrft_packed"]
    assert [r.prompt for r in layout.rows] == batch["prompt_lengths"][[0, 3, 4, 10, 12]].tolist()
    assert sorted(b.rows.tolist() for b in layout.blocks) == [[0, 4], [1], [2], [3]]
    head = torch.empty(1, 1, 1, model.config.text_config.hidden_size // model.config.text_config.num_attention_heads)
    explicit = {tuple(b.rows.tolist()): _explicit_scores(head, b.mask.shape[2], 0.0) for b in layout.blocks}
    assert explicit == {(0, 4): True, (1,): False, (2,): True, (3,): True}
    dense = {k: v for k, v in packed.inputs.items() if k != "vlrft_packed"}
    lengths = torch.tensor([r.length for r in layout.rows])
    keep = torch.arange(layout.width)[None] < lengths[:, None]  # the rows' real tokens (padding is never read)

    def run(inputs):
        model.zero_grad()
        logits = model(**inputs, use_cache=False).logits
        (logits[keep].float().pow(2).mean()).backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        return logits.detach()[keep], grads

    got, g_got = run(packed.inputs)
    want, g_want = run(dense)
    everything = dict(packed.inputs, attention_mask=torch.ones_like(packed.inputs["attention_mask"]))
    unmasked, _ = run(everything)
    unmasked_dense, _ = run({k: v for k, v in everything.items() if k != "vlrft_packed"})
    assert (unmasked - want).abs().max() < FORWARD_BOUND  # the layout, not the mask, decided what was seen
    assert (unmasked_dense - want).abs().max() > 1e-2  # the same all-pairs mask without the layout: other outputs
    assert_within((got - want).abs().max(), FORWARD_BOUND, "packed attention vs dense block mask: logits")
    worst = max(((g_got[k] - g_want[k]).norm() / g_want[k].norm().clamp_min(1e-12)).item() for k in g_want)
    assert set(g_got) == set(g_want) and any(k.startswith("model.visual") for k in g_got)
    assert_within(worst, FORWARD_BOUND, "packed attention vs dense block mask: worst relative gradient difference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefix_decode_attention_equals_attention_over_the_expanded_cache(dtype):
    """The decode attention over a SharedPrefixLayer (each prompt's keys once for its n samples) against a float64
    softmax over the expanded cache (every sample's prompt copy followed by its own keys), with left padding in the
    prompts, grouped KV heads and two new tokens per step (causal among them)."""
    from vlrft.models.packed_attention import packed_sdpa
    from vlrft.models.prefix_decoding import SharedPrefixLayer

    g = torch.Generator().manual_seed(0)
    prompts, n, kv_heads, heads, plen, dim, q = 2, 3, 2, 4, 5, 8, 2
    pk, pv = (
        torch.randn(prompts, kv_heads, plen, dim, generator=g).to(dtype),
        torch.randn(prompts, kv_heads, plen, dim, generator=g).to(dtype),
    )
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)  # prompt 0 left-padded by 2
    layer = SharedPrefixLayer(pk, pv, prompt_mask, n, room=2)  # room 2: the second update doubles it
    batch = prompts * n
    for step in range(3):
        k_new = torch.randn(batch, kv_heads, q, dim, generator=g).to(dtype)
        v_new = torch.randn(batch, kv_heads, q, dim, generator=g).to(dtype)
        query = torch.randn(batch, heads, q, dim, generator=g).to(dtype)
        keys, values = layer.update(k_new, v_new, 0)
        assert keys.dtype == values.dtype == dtype  # the samples' own cache stays in the model's dtype
        assert layer.get_seq_length() == plen + q * (step + 1) and keys.shape[-2] == q * (step + 1)
        attn = torch.nn.Module()
        attn.is_causal, attn.scaling = True, dim**-0.5
        got, _ = packed_sdpa(attn, query, keys, values, None, scaling=attn.scaling)  # [B, q, heads, dim]

        # float64 reference: each sample's full key list (its prompt copy, then its own), head h on KV head h // 2
        t = keys.shape[-2]
        full_k = torch.cat([pk.repeat_interleave(n, 0), keys], dim=2).double().repeat_interleave(heads // kv_heads, 1)
        full_v = torch.cat([pv.repeat_interleave(n, 0), values], dim=2).double().repeat_interleave(heads // kv_heads, 1)
        scores = query.double() @ full_k.transpose(-1, -2) * dim**-0.5  # [B, heads, q, P + t]
        own_ok = torch.arange(t)[None] <= torch.arange(t - q, t)[:, None]  # [q, t]
        ok = torch.cat(
            [
                prompt_mask.repeat_interleave(n, 0)[:, None, None, :].expand(-1, 1, q, -1),
                own_ok[None, None].expand(batch, 1, -1, -1),
            ],
            dim=-1,
        )
        want = (scores.masked_fill(~ok, float("-inf")).softmax(-1) @ full_v).transpose(1, 2)
        assert got.dtype == dtype
        if dtype == torch.float32:
            # float32 scores and sums of 5 + 6 terms of O(1) products: a few ulps (1e-7) each; 1e-5 is far above
            err, bound = (got.double() - want).abs().max(), FORWARD_BOUND
        else:  # computed in float32, rounded once to bf16 (8 significant bits): relative error <= 2^-8, bound twice it
            err, bound = ((got.double() - want).abs() / want.abs().clamp_min(1e-3)).max(), 2**-7
        assert_within(err, bound, f"shared-prefix decode attention {dtype}, step {step}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("additive", [False, True])
def test_grouped_decode_attention_equals_attention_over_the_repeated_cache(dtype, additive):
    """A decode step with grouped KV heads and a padded cache (a static cache's unfilled tail, left padding): the
    query heads of each KV head attending as its queries (no copy of the cache) against a float64 softmax over the
    cache repeated per query head (transformers' ``repeat_kv``), with a bool and an additive mask; ``packed_sdpa``
    takes this path for such a step and gives what transformers' SDPA attention gives."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from vlrft.models.packed_attention import grouped_decode_attention, packed_sdpa

    g = torch.Generator().manual_seed(1)
    batch, kv_heads, groups, length, dim = 3, 2, 4, 7, 8
    heads = kv_heads * groups
    query = torch.randn(batch, heads, 1, dim, generator=g).to(dtype)
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=g).to(dtype) for _ in range(2))
    filled = torch.tensor([[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    mask = filled[:, None, None, :]  # [B, 1, 1, S]: each row's own padding, shared by its heads
    if additive:
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    got, _ = grouped_decode_attention(query, key, value, mask, dim**-0.5)

    # float64 reference: head h reads KV head h // groups, the padding masked out
    full_k = key.double().repeat_interleave(groups, 1)
    full_v = value.double().repeat_interleave(groups, 1)
    scores = (query.double() @ full_k.transpose(-1, -2) * dim**-0.5).masked_fill(~filled[:, None, None], float("-inf"))
    want = (scores.softmax(-1) @ full_v).transpose(1, 2)  # [B, 1, heads, dim]
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:  # float32 sums of <= 7 O(1) products and a 7-term softmax: a few ulps (1e-7) each
        err, bound = (got.double() - want).abs().max(), FORWARD_BOUND
    else:  # bf16 keeps 8 significant bits: a rounding is at most 2^-8 relative (about 2^-9 typical). The output is
        # rounded once, and a kernel computing in bf16 rounds the scores and the softmax weights too (the softmax's
        # conditioning is about 1 at these O(1) scores): bound 2^-6, four roundings; measured ~1.9e-3 normwise, about
        # one typical rounding of the output
        err, bound = (got.double() - want).norm() / want.norm(), 2**-6
    assert_within(err, bound, f"grouped decode attention {dtype}, {'additive' if additive else 'bool'} mask")

    attn = torch.nn.Module()
    attn.is_causal, attn.scaling, attn.num_key_value_groups = True, dim**-0.5, groups
    routed, _ = packed_sdpa(attn, query, key, value, mask)
    assert torch.equal(routed, got)  # packed_sdpa computes such a step with the grouped attention
    plain, _ = sdpa_attention_forward(attn, query, key, value, mask, scaling=attn.scaling)  # over repeat_kv's copies
    diff = (routed.double() - plain.double()).norm() / plain.double().norm()
    assert_within(diff, FORWARD_BOUND if dtype == torch.float32 else 2**-6, f"grouped decode vs SDPA, {dtype}")


@pytest.mark.parametrize("bounds", [[0, 4, 8, 12], [0, 3, 3, 7, 12]], ids=["one-length", "mixed-and-empty"])
def test_varlen_vision_attention_equals_float64_per_sequence_gradients_included(bounds):
    """``varlen_sdpa`` (a vision tower's packed sequences, those of one length in one SDPA call) against a float64
    softmax over each sequence alone, outputs and the gradients of query, key and value: sequences of one length
    (reshaped, no gather), and of several lengths with an empty one (Qwen2.5-VL's window bounds can repeat)."""
    from vlrft.models.vision_attention import varlen_sdpa

    g = torch.Generator().manual_seed(2)
    heads, total, dim = 2, bounds[-1], 8
    qkv = [torch.randn(1, heads, total, dim, generator=g, requires_grad=True) for _ in range(3)]
    weight = torch.randn(1, total, heads, dim, generator=g)
    cu = torch.tensor(bounds, dtype=torch.int32)
    got, _ = varlen_sdpa(torch.nn.Module(), *qkv, scaling=dim**-0.5, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    (got * weight).sum().backward()
    got_grads = [x.grad.clone() for x in qkv]

    ref = [x.detach().double().requires_grad_() for x in qkv]
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        q, k, v = (x[:, :, a:b] for x in ref)
        pieces.append(((q @ k.transpose(-1, -2)) * dim**-0.5).softmax(-1) @ v)
    want = torch.cat(pieces, dim=2).transpose(1, 2)  # [1, T, heads, dim]
    (want * weight.double()).sum().backward()
    # float32 dot products of 8 O(1) terms and softmaxes over <= 5 keys: a few ulps (1e-7) each; 1e-5 is far above
    assert_within((got.double() - want).abs().max(), FORWARD_BOUND, f"varlen attention {bounds}")
    worst = max((gg.double() - r.grad).abs().max().item() for gg, r in zip(got_grads, ref))
    assert_within(worst, FORWARD_BOUND, f"varlen attention gradients {bounds}")


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vision_towers_attend_through_varlen_sdpa_as_through_per_sequence_sdpa(tiny_model, arch):
    """The one loader gives a Qwen-VL model's vision tower ``varlen_sdpa`` (its text layers keep SDPA); the image
    features and the vision tower's gradients are those of transformers' per-sequence SDPA calls (two images of
    other sizes: several lengths of images, and of Qwen2.5-VL's windows)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model, proc = load_model(tiny_model(arch))
    vision = model.model.visual
    attention = [m for m in vision.modules() if type(m).__name__.endswith("VisionAttention")]
    assert len(attention) == len(vision.blocks) and len({id(m.config) for m in attention}) == 1
    own = attention[0].config
    assert own._attn_implementation == VARLEN_SDPA
    # the model's own config keeps SDPA (what is saved, and what a model built from it gets; a name with "flash" in
    # it would make transformers look for a flash kernel there), and so do the text layers; the tower holds the
    # attention's copy (it computes the longest sequence once per forward for all its blocks)
    assert model.config.vision_config._attn_implementation == model.config.get_text_config()._attn_implementation
    assert model.config.get_text_config()._attn_implementation == "sdpa" and vision.config is own
    type(model)(model.config)
    images = [_image(4, (112, 84)), _image(5, (56, 140))]
    pixels = proc.image_processor(images=images, return_tensors="pt")
    weight = None
    results = {}
    calls = []
    original = ALL_ATTENTION_FUNCTIONS[VARLEN_SDPA]
    ALL_ATTENTION_FUNCTIONS.register(VARLEN_SDPA, lambda *a, **k: calls.append(1) or original(*a, **k))
    try:
        for impl in ("sdpa", VARLEN_SDPA):
            own._attn_implementation = impl
            model.zero_grad()
            out = model.model.get_image_features(
                pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"]
            )
            out = torch.cat(list(getattr(out, "pooler_output", out)))
            weight = torch.linspace(-1, 1, out.numel()).view_as(out) if weight is None else weight
            (out * weight).sum().backward()
            results[impl] = (
                out.detach(),
                {k: p.grad.clone() for k, p in vision.named_parameters() if p.grad is not None},
            )
    finally:
        ALL_ATTENTION_FUNCTIONS.register(VARLEN_SDPA, original)
    assert len(calls) == len(vision.blocks)  # one call per layer, every layer
    (plain, plain_grads), (varlen, varlen_grads) = results["sdpa"], results[VARLEN_SDPA]
    assert_within(((varlen - plain).norm() / plain.norm()).item(), FORWARD_BOUND, f"{arch}: varlen vs per-sequence")
    assert set(plain_grads) == set(varlen_grads) and len(plain_grads) > 10
    worst = max(((varlen_grads[k] - g).norm() / g.norm().clamp_min(1e-12)).item() for k, g in plain_grads.items())
    assert_within(worst, FORWARD_BOUND, f"{arch}: varlen vs per-sequence, worst relative gradient difference")


@pytest.mark.parametrize("onednn", [False, True])
def test_packed_responses_explicit_attention_equals_float64_gradients_included(onednn, monkeypatch):
    """The explicit attention of a block's responses (``_prefix_attention`` with each response's queries its own
    keys: ``q == t``, causal, no prompt padding), which CPU training takes for responses no longer than the head
    dimension, against a float64 softmax over each response's copy of its prompt followed by its own keys:
    outputs and the gradients wrt the queries, the responses' keys and values and the prompt's keys and values.
    ``onednn``: the products over the prompt by ``cpu_matmul.onednn_matmul`` (``strategy.cpu_matmul``), its size
    threshold lowered so that these small products take it."""
    from vlrft.models import cpu_matmul
    from vlrft.models.prefix_decoding import prefix_attention as _prefix_attention

    if onednn:
        if not cpu_matmul.onednn_available():
            pytest.skip("this PyTorch has no oneDNN float32 linear kernel")
        monkeypatch.setattr(cpu_matmul, "MATMUL_MIN_MACS", 0)

    g = torch.Generator().manual_seed(0)
    prompts, n, kv_heads, heads, plen, dim, length = 2, 3, 2, 4, 5, 8, 4
    batch = prompts * n
    shapes = [(batch, heads, length, dim), (batch, kv_heads, length, dim), (batch, kv_heads, length, dim)]
    shapes += [(prompts, kv_heads, plen, dim)] * 2
    inputs = [torch.randn(*s, generator=g) for s in shapes]  # query, own keys, own values, prompt keys, values
    grad_out = torch.randn(batch, length, heads, dim, generator=g)

    def run(dtype, fn):
        xs = [x.to(dtype).clone().requires_grad_() for x in inputs]
        out = fn(*xs)
        out.backward(grad_out.to(dtype))
        return out.detach(), [x.grad for x in xs]

    def reference(q, k, v, pk, pv):  # every response's copy of its prompt, then its own keys; head h on KV head h // 2
        full_k = torch.cat([pk.repeat_interleave(n, 0), k], dim=2).repeat_interleave(heads // kv_heads, 1)
        full_v = torch.cat([pv.repeat_interleave(n, 0), v], dim=2).repeat_interleave(heads // kv_heads, 1)
        ok = torch.cat([torch.ones(length, plen, dtype=torch.bool), torch.ones(length, length).tril().bool()], 1)
        scores = (q @ full_k.transpose(-1, -2) * dim**-0.5).masked_fill(~ok, float("-inf"))
        return (scores.softmax(-1) @ full_v).transpose(1, 2)

    matmul = cpu_matmul.onednn_matmul if onednn else torch.matmul
    got, got_grads = run(
        torch.float32, lambda q, k, v, pk, pv: _prefix_attention(q, k, v, pk, pv, None, dim**-0.5, matmul=matmul)[0]
    )
    want, want_grads = run(torch.float64, reference)
    # float32 products and sums of 5 + 4 terms of O(1) values, a few ulps (1e-7) each, and the gradients' sums of
    # as many such terms over responses and heads: ~1e-6 at worst; 1e-5 is far above
    assert_within((got.double() - want).abs().max(), FORWARD_BOUND, "explicit responses' attention vs float64")
    for name, a, b in zip(["query", "keys", "values", "prompt keys", "prompt values"], got_grads, want_grads):
        assert_within((a.double() - b).abs().max(), FORWARD_BOUND, f"explicit responses' attention: d/d {name}")


def test_engine_keeps_the_expanded_cache_for_attention_other_than_sdpa(tiny_model):
    """An eager-attention model cannot read a SharedPrefixLayer (its attention would see the samples' own keys
    only): the engine expands the cache instead, and prefill-once still samples the plain path's tokens."""
    model, proc = load_model(tiny_model("qwen2"), torch.float32)
    model.config._attn_implementation = "eager"
    prompts = [encode_prompt(proc, r) for r in _records(with_images=False)]
    engine = make_engine("hf", model, proc)
    results = {}
    for once in (True, False):
        engine.prefill_once = once
        torch.manual_seed(3)
        results[once] = [
            x.response_ids.tolist() for x in engine.generate(prompts, SamplingParams(n=3, max_new_tokens=6))
        ]
    assert results[True] == results[False]
    assert model.config._attn_implementation == "eager"  # not switched to packed_sdpa
