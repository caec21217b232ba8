"""Keyed sampling (``SamplingParams.keys``, ``vlrft.rollout.keyed``): the tokens drawn for a prompt depend on its key
only, not on which rank or which generate call samples it.

- the keyed uniforms are SplitMix64 bit for bit (a pure-Python uint64 reference), the same for a row alone, among
  other rows and on a second call; the sampling key is a stable hash (a value fixed here, in any process);
- Gumbel-max over them draws from the softmax: 20000 draws of a fixed 8-way distribution within 4 standard errors per
  token, over the n samples of one key and over many keys at a later position; top-k / top-p filtered tokens are
  never drawn and the rest follow the renormalised distribution;
- on the hf engine with a real tiny Qwen2.5-VL: a prompt alone, among prompts of other widths (left padding) and
  images, in micro-batches of 1, with the prompts repeated instead of prefilled once, with a static cache, after
  another torch seed: the same tokens; the reported log-probs are the trainer's recomputed ones within 1e-5;
  ``keys=None`` draws what transformers' own generate draws for a torch seed; FIRE with keys keeps all of this and its
  first token follows the hot softmax; a multi-turn trajectory's later turns follow its key too.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import pytest
import torch
from PIL import Image
from tolerance import assert_within

from data_pipelines.collate import collate_prompts, collate_sequences, encode_prompt
from data_pipelines.records import PromptRecord
from vlrft.config import load_config
from vlrft.models.loading import load_model
from vlrft.rollout import SamplingParams, make_engine
from vlrft.rollout.base import sampling_key, vision_token_ids
from vlrft.rollout.generation import sample_rollouts
from vlrft.rollout.hf import HFEngineConfig
from vlrft.rollout.hf_engine import DrawnDistribution
from vlrft.rollout.keyed import GOLDEN, gumbel_max, keyed_uniform, row_keys
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.experience import response_logprobs, response_tensors

U64 = (1 << 64) - 1
P8 = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02], dtype=torch.float64)


def _splitmix64(x: int) -> int:
    """SplitMix64's output function on Python integers (uint64: every product reduced modulo 2**64)."""
    x &= U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


def test_keyed_uniforms_are_splitmix64_bit_for_bit():
    keys = [0, 5, (1 << 63) - 1, 0x0123456789ABCDEF]
    rows = row_keys(keys, 3)
    position, vocab = 7, 40
    u = keyed_uniform(rows, position, vocab)
    assert u.dtype == torch.float64 and u.shape == (12, vocab)
    for r, (key, j) in enumerate((k, j) for k in keys for j in range(3)):
        row = _splitmix64(key + (j + 1) * GOLDEN)
        assert int(rows[r]) & U64 == row  # sample j: the j-th output of the key's stream
        state = _splitmix64(row + (position + 1) * GOLDEN)
        want = [((_splitmix64(state + (t + 1) * GOLDEN) >> 11) + 0.5) * 2.0**-53 for t in range(vocab)]
        assert u[r].tolist() == want
    assert 0 < float(u.min()) and float(u.max()) < 1


def test_a_rows_noise_is_the_same_alone_among_other_rows_and_on_another_call():
    keys = row_keys([11, 22, 33, 44], 2)
    together = keyed_uniform(keys, 3, 500)
    for r in range(keys.numel()):
        assert torch.equal(keyed_uniform(keys[r : r + 1], 3, 500)[0], together[r])
    assert torch.equal(keyed_uniform(keys.flip(0), 3, 500), together.flip(0))
    assert torch.equal(keyed_uniform(keys, 3, 500), together)
    # every row, position and sample its own noise
    assert not torch.equal(keyed_uniform(keys, 4, 500), together)
    assert len({round(float(x), 12) for x in together[:, 0]}) == keys.numel()


def test_gumbel_max_over_vocabulary_slices_draws_the_tokens_of_one_argmax(monkeypatch):
    """gumbel_max takes the vocabulary in slices (bounded memory); a slice's noise is the whole row's columns, and the
    tokens are bitwise those of one argmax over the whole vocabulary, also where the best token sits in the last slice
    or where a slice is all -inf."""
    from vlrft.rollout import keyed

    keys = row_keys([5, 6, 7], 3)
    whole = keyed_uniform(keys, 2, 1000)
    assert torch.equal(keyed_uniform(keys, 2, 1000, start=640), whole[:, 640:])
    logp = torch.randn(9, 1000, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    logp[0, :64] = float("-inf")  # a slice where this row can draw nothing
    logp[1, 999] = 50.0  # the best token in the last slice
    want = (logp.double() - torch.log(-torch.log(whole))).argmax(-1)
    monkeypatch.setattr(keyed, "NOISE_CHUNK", 9 * 64)  # slices of 64 tokens
    got = gumbel_max(logp, keys, 2)
    assert torch.equal(got, want) and int(got[1]) == 999 and int(got[0]) >= 64
    monkeypatch.setattr(keyed, "NOISE_CHUNK", 1 << 22)  # one slice
    assert torch.equal(gumbel_max(logp, keys, 2), want)


def test_the_sampling_key_is_a_stable_hash_of_seed_step_and_prompt_id():
    assert sampling_key(0, 1, "a") == 437785126749045565  # the same in every process (no PYTHONHASHSEED)
    digest = hashlib.blake2b(b"vlrft-sampling-key\x001234\x007\x00gsm8k/42", digest_size=8).digest()
    assert sampling_key(1234, 7, "gsm8k/42") == int.from_bytes(digest, "little") & ((1 << 63) - 1)
    keys = {sampling_key(s, t, p) for s in (0, 1) for t in (0, 1, 2) for p in ("a", "b", "ab")}
    assert len(keys) == 18 and all(0 <= k < 1 << 63 for k in keys)
    with pytest.raises(ValueError, match=r"keys: -1 is not a sampling key"):
        SamplingParams(keys=[3, -1])
    with pytest.raises(ValueError, match=r"keys: 1 sampling keys for 2 prompts"):
        SamplingParams(keys=[3]).check_keys(2)


def _frequencies_within_4_standard_errors(tokens: torch.Tensor, p: torch.Tensor) -> None:
    n = tokens.numel()
    seen = torch.bincount(tokens, minlength=p.numel()).double() / n
    se = (p * (1 - p) / n).sqrt()
    for t in range(p.numel()):
        if p[t] == 0:
            assert seen[t] == 0, (t, seen)
        else:
            assert abs(float(seen[t] - p[t])) < 4 * float(se[t]), (t, float(seen[t]), float(p[t]), float(se[t]))


def test_gumbel_max_draws_from_the_softmax():
    logp = P8.log().float()[None].expand(20000, -1)
    # the 20000 samples of one prompt (distinct streams per sample), at the first position
    _frequencies_within_4_standard_errors(gumbel_max(logp, row_keys([987654321], 20000), 0), P8)
    # 20000 prompts of one sample each, at a later position
    keys = row_keys([sampling_key(0, 3, f"p{i}") for i in range(20000)], 1)
    later = gumbel_max(logp, keys, 17)
    _frequencies_within_4_standard_errors(later, P8)
    # the next position's draw is independent of this one's: the pair follows the product distribution
    pairs = later * 8 + gumbel_max(logp, keys, 18)
    _frequencies_within_4_standard_errors(pairs, torch.outer(P8, P8).flatten())


@pytest.mark.parametrize(
    ("filters", "kept"),
    [(dict(top_k=3), [0, 1, 2]), (dict(top_p=0.6), [0, 1, 2]), (dict(top_k=5, top_p=0.5), [0, 1])],
)
def test_keyed_draws_never_pick_a_filtered_token(filters, kept):
    rows, width = 20000, 5
    sampling = SamplingParams(temperature=0.5, keys=[1], **filters)
    drawn = DrawnDistribution(width, sampling, row_keys([42], rows))
    logits = (P8.log() * 0.5).float()[None].repeat(rows, 1)  # at temperature 0.5: P8 again
    scores = drawn(torch.zeros((rows, width), dtype=torch.long), logits)
    tokens = scores.argmax(-1)
    # one finite score per row: generate (greedy) can pick that token only
    assert torch.isfinite(scores).sum(-1).eq(1).all() and scores.gather(-1, tokens[:, None]).eq(0).all()
    p = torch.zeros_like(P8)
    p[kept] = P8[kept] / P8[kept].sum()
    _frequencies_within_4_standard_errors(tokens, p)
    # the log-probs it keeps are those of the filtered distribution the token was drawn from
    assert torch.allclose(drawn._last[0].double().exp(), p, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- the hf engine
@pytest.fixture(scope="module")
def policy(tiny_model):
    model, processor = load_model(str(tiny_model("qwen2_5_vl")), "float32")
    return model.eval(), processor


def _prompts(processor):
    records = [
        PromptRecord(id="a", prompt="red green blue"),
        PromptRecord(id="b", prompt="What colour? <image>", images=[Image.new("RGB", (56, 84), (255, 0, 0))]),
        PromptRecord(id="c", prompt="A much longer text-only prompt, so that the others are left-padded to it."),
        PromptRecord(id="d", prompt="<image> and <image>", images=[Image.new("RGB", (112, 112), (0, 0, 255))] * 2),
    ]
    return records, [encode_prompt(processor, r) for r in records]


KEYS = [sampling_key(7, 1, x) for x in "abcd"]
PLAIN = HFEngineConfig(inference_copy="off", compile="off")
PATHS = {
    "together": dict(hf=PLAIN),
    "micro-batches of 1": dict(hf=PLAIN, micro_rollout_batch_size=1),
    "prompts repeated (the synced path)": dict(hf=PLAIN, prefill_once=False),
    "static cache": dict(hf=HFEngineConfig(inference_copy="off", compile="on")),
}


def _ids(rollouts) -> list[list[int]]:
    return [x.response_ids.tolist() for x in rollouts]


def _engine(model, processor, spec: dict):
    spec = dict(spec)
    prefill_once = spec.pop("prefill_once", True)
    engine = make_engine("hf", model, processor, **spec)
    engine.prefill_once = prefill_once
    return engine


def test_a_prompts_tokens_are_the_same_alone_and_on_every_path(policy):
    model, processor = policy
    _, prompts = _prompts(processor)
    sampling = SamplingParams(n=3, temperature=1.0, top_k=50, max_new_tokens=6, keys=KEYS)
    alone = []
    engine = _engine(model, processor, PATHS["together"])
    for p, key in zip(prompts, KEYS):
        torch.manual_seed(len(alone))  # the global RNG plays no part
        alone += _ids(
            engine.generate([p], SamplingParams(n=3, temperature=1.0, top_k=50, max_new_tokens=6, keys=[key]))
        )
    assert len({tuple(x) for x in alone}) == len(alone)  # the samples of a prompt, and the prompts, differ
    for name, spec in PATHS.items():
        torch.manual_seed(100)
        got = _engine(model, processor, spec).generate(prompts, sampling)
        assert [x.prompt_index for x in got] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
        assert _ids(got) == alone, name
    # reordered prompts carry their keys: each prompt's samples as before
    order = [2, 0, 3, 1]
    shuffled = engine.generate([prompts[i] for i in order], replace(sampling, keys=None))
    assert _ids(shuffled) != [x for i in order for x in alone[3 * i : 3 * i + 3]]  # unkeyed: the global RNG's
    keyed = engine.generate([prompts[i] for i in order], replace(sampling, keys=[KEYS[i] for i in order]))
    assert _ids(keyed) == [x for i in order for x in alone[3 * i : 3 * i + 3]]
    # greedy ignores the keys
    greedy = SamplingParams(n=1, temperature=0, max_new_tokens=6)
    assert _ids(engine.generate(prompts, greedy)) == _ids(engine.generate(prompts, replace(greedy, keys=KEYS)))


def test_sample_rollouts_passes_one_key_per_record(policy):
    model, processor = policy
    records, prompts = _prompts(processor)
    engine = make_engine("hf", model, processor, hf=PLAIN)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=5)
    _, got = sample_rollouts(engine, processor, records, sampling, system_prompt=None, prompt_template=None, keys=KEYS)
    want = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=5, keys=KEYS))
    assert _ids(got) == _ids(want)
    with pytest.raises(ValueError, match="keys: 3 sampling keys for 4 prompts"):
        sample_rollouts(engine, processor, records, sampling, system_prompt=None, prompt_template=None, keys=KEYS[:3])


def test_keyed_log_probs_are_the_trainers(policy):
    model, processor = policy
    _, prompts = _prompts(processor)
    t = 0.8
    engine = make_engine("hf", model, processor, hf=PLAIN)
    rollouts = engine.generate(prompts, SamplingParams(n=2, temperature=t, max_new_tokens=6, logprobs=True, keys=KEYS))
    responses = [x.response_ids for x in rollouts]
    index = [x.prompt_index for x in rollouts]
    batch = collate_sequences(prompts, index, responses, processor.tokenizer.pad_token_id)
    ids, mask = response_tensors(responses, processor.tokenizer.pad_token_id)
    suppress = torch.tensor(vision_token_ids(processor.tokenizer))
    with torch.no_grad():
        trainer, _ = response_logprobs(model, batch, ids, temperature=t, suppress=suppress)
    engine_lp = torch.zeros_like(trainer)
    for i, x in enumerate(rollouts):
        engine_lp[i, : x.logprobs.numel()] = x.logprobs
    assert mask.sum() >= 30
    # float32 log-softmax of the same logits in two batch layouts (generate's cache vs one forward): a few ulps of ~7
    assert_within((engine_lp - trainer)[mask.bool()].abs().max(), 1e-5, "keyed engine log-probs vs the trainer's")
    # without logprobs asked, keyed sampling reports none (as unkeyed) and draws the same tokens
    plain = engine.generate(prompts, SamplingParams(n=2, temperature=t, max_new_tokens=6, keys=KEYS))
    assert all(x.logprobs is None for x in plain) and _ids(plain) == _ids(rollouts)


def test_without_keys_the_tokens_are_transformers_generates_for_a_torch_seed(policy):
    model, processor = policy
    text = [encode_prompt(processor, PromptRecord(id=i, prompt=p)) for i, p in (("a", "red"), ("b", "one two three"))]
    engine = make_engine("hf", model, processor, hf=PLAIN)
    engine.prefill_once = False  # the inputs generate gets: the left-padded prompts, each repeated n times
    sampling = SamplingParams(n=3, temperature=0.9, top_k=40, top_p=0.95, max_new_tokens=6)
    torch.manual_seed(5)
    got = _ids(engine.generate(text, sampling))
    batch = collate_prompts(text, processor.tokenizer.pad_token_id)
    width = batch["input_ids"].shape[1]
    torch.manual_seed(5)
    with torch.no_grad():
        ref = model.generate(
            input_ids=batch["input_ids"].repeat_interleave(3, 0),
            attention_mask=batch["attention_mask"].repeat_interleave(3, 0),
            do_sample=True,
            temperature=0.9,
            top_k=40,
            top_p=0.95,
            max_new_tokens=6,
            eos_token_id=engine.eos_ids,
            pad_token_id=engine.pad_id,
            suppress_tokens=engine.suppress,
        )[:, width:]
    assert got == [ref[i, : len(x)].tolist() for i, x in enumerate(got)]
    # the log-probs processor without keys leaves generate's draw as it was
    torch.manual_seed(5)
    with_logprobs = engine.generate(text, replace(sampling, logprobs=True))
    assert _ids(with_logprobs) == got


def test_fire_with_keys(policy):
    model, processor = policy
    _, prompts = _prompts(processor)
    hot_t, t, top_k, n = 1.0, 0.02, 8, 2000
    engine = make_engine("hf", model, processor, hf=PLAIN)
    sampling = SamplingParams(n=3, temperature=0.7, max_new_tokens=4, first_token_temperature=3.0, keys=KEYS)
    together = engine.generate(prompts, sampling)
    for i, p in enumerate(prompts):
        one = replace(sampling, keys=[KEYS[i]])
        assert _ids(engine.generate([p], one)) == _ids(together[3 * i : 3 * i + 3])
    assert _ids(_engine(model, processor, PATHS["static cache"]).generate(prompts, sampling)) == _ids(together)
    # the first token's log-prob is the hot one
    x = together[0]
    whole = torch.cat([prompts[0].input_ids, x.response_ids])[None]
    with torch.no_grad():
        logits = model(input_ids=whole, attention_mask=torch.ones_like(whole)).logits[0].double()
    logits[:, vision_token_ids(processor.tokenizer)] = -math.inf
    start, r = prompts[0].input_ids.numel() - 1, x.response_ids.numel()
    temps = torch.tensor([3.0] + [0.7] * (r - 1), dtype=torch.float64)[:, None]
    ref = torch.log_softmax(logits[start : start + r] / temps, -1).gather(-1, x.response_ids[:, None]).squeeze(-1)
    assert_within((x.logprobs.double() - ref).abs().max(), 1e-5, "keyed FIRE log-probs vs float64")

    # the first token of n samples of one key follows the hot softmax (top-k), far from the cold one
    many = engine.generate(
        [prompts[0]],
        SamplingParams(n=n, temperature=t, top_k=top_k, max_new_tokens=1, first_token_temperature=hot_t, keys=[9]),
    )
    scaled = logits[start]
    kept = scaled.topk(top_k).indices
    hot = torch.zeros_like(scaled).index_copy(0, kept, torch.softmax(scaled[kept] / hot_t, -1))
    cold = torch.zeros_like(scaled).index_copy(0, kept, torch.softmax(scaled[kept] / t, -1))
    firsts = torch.tensor([int(x.response_ids[0]) for x in many])
    seen = torch.bincount(firsts, minlength=scaled.numel()).double() / n
    # total variation: E <= 1/2 sqrt((k - 1) / n) plus McDiarmid's sqrt(ln(1000) / 2n) (the FIRE test's bound)
    bound = 0.5 * math.sqrt((top_k - 1) / n) + math.sqrt(math.log(1000) / (2 * n))
    tv = 0.5 * float((seen - hot).abs().sum())
    assert tv < bound, (tv, bound)  # a statistical bound (exceeded with probability 1e-3), not a rounding one
    assert 0.5 * float((hot - cold).abs().sum()) > 3 * bound


def test_a_trajectorys_later_turns_follow_its_key(tool_policy):
    from data_pipelines.collate import processor_image_kwargs
    from data_pipelines.synthetic import make_prompt_records
    from vlrft.rollout.trajectories import TrajectoryRunner
    from vlrft.tools import ToolBox, ToolsConfig

    model, processor = load_model(tool_policy, "float32")
    model.eval()
    cfg = ToolsConfig(names=["zoom"], max_turns=3, max_tokens=256)
    box = ToolBox(cfg, processor_image_kwargs(processor))
    keys = [sampling_key(0, 1, "x"), sampling_key(0, 1, "y")]
    try:
        runner = TrajectoryRunner(make_engine("hf", model, processor, hf=PLAIN), processor, box, cfg)
        records = make_prompt_records("mark_color", 2, seed=7, image_size=256)
        prompts = [encode_prompt(processor, r, tools=box.schemas) for r in records]
        sampling = SamplingParams(n=4, temperature=0.5, top_k=4, max_new_tokens=32, keys=keys)
        both = runner.run(records, prompts, sampling)
        second = runner.run(records[1:], prompts[1:], replace(sampling, keys=keys[1:]))
    finally:
        box.close()
    assert any(len(x.trajectory.turns) >= 2 for x in both[4:]), [x.trajectory.turns for x in both[4:]]
    assert _ids(second) == _ids(both[4:])
    assert [x.trajectory.action_mask.tolist() for x in second] == [x.trajectory.action_mask.tolist() for x in both[4:]]


def test_keyed_sampling_is_a_rollout_option():
    assert load_config(PolicyTrainConfig, None, []).rollout.keyed_sampling is None
    assert load_config(PolicyTrainConfig, None, ["rollout.keyed_sampling=true"]).rollout.keyed_sampling is True
    assert load_config(PolicyTrainConfig, None, []).rollout.sampling().keys is None
