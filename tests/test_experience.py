"""Response log-probs gathered from the response region equal a direct full-sequence computation."""

from __future__ import annotations

import torch
from PIL import Image
from tolerance import assert_within

from data_pipelines.collate import collate_sequences, encode_prompt, model_inputs
from data_pipelines.records import PromptRecord
from vlrft.trainer.experience import Experience, response_logprobs, response_tensors


def test_response_logprobs_match_direct_computation(tiny_model):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import vlrft.models  # noqa: F401

    path = tiny_model("qwen2_5_vl")
    model, proc = AutoModelForImageTextToText.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)
    recs = [
        PromptRecord(id="a", prompt="<image> colour?", images=[Image.new("RGB", (56, 56), (0, 0, 255))]),
        PromptRecord(id="b", prompt="A longer text-only prompt with more tokens in it."),
    ]
    prompts = [encode_prompt(proc, r) for r in recs]
    responses = [torch.tensor([11, 12, 13, 14]), torch.tensor([21]), torch.tensor([31, 32])]
    index = [0, 1, 0]
    batch = collate_sequences(prompts, index, responses, proc.tokenizer.pad_token_id)
    ids, mask = response_tensors(responses, proc.tokenizer.pad_token_id)
    temperature = 0.7
    with torch.no_grad():
        got, entropy = response_logprobs(model, batch, ids, temperature=temperature, with_entropy=True)
        full = model(**model_inputs(batch)).logits.double() / temperature
    logp_all = full.log_softmax(-1)
    # float32 log-softmax over ~1e3 logits against float64 on the same logits: a few ulps of log-probs of ~7
    # (~1e-6); the entropy sums 1e3 such terms (~1e-5)
    for i, r in enumerate(responses):
        p = prompts[index[i]].input_ids.numel()
        for j, tok in enumerate(r.tolist()):
            expected = logp_all[i, p + j - 1, tok].item()  # logits at position t predict token t + 1
            assert_within(abs(got[i, j].item() - expected), 1e-5, "float32 log-prob vs float64")
            ent = -(logp_all[i, p + j - 1].exp() * logp_all[i, p + j - 1]).sum().item()
            assert_within(abs(entropy[i, j].item() - ent), 1e-4, "float32 entropy vs float64")
    assert mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]

    # a micro-batch selected from the experience gives the same log-probs
    exp = Experience(batch, ids, mask, None, None, torch.zeros(3), torch.zeros(3, 4), torch.tensor(index))
    sub = exp.micro_batch(torch.tensor([2, 1]))
    assert sub["image_grid_thw"].shape[0] == 1  # only sample 2 has an image
    with torch.no_grad():
        again, _ = response_logprobs(model, sub, sub["response_ids"], temperature=temperature)
    # the same forward in another batch layout: a few ulps of ~7 through ~10 reordered sums, ~1e-6 at worst
    worst = max((again[0, :2] - got[2, :2]).abs().max(), (again[1, :1] - got[1, :1]).abs().max())
    assert_within(worst, 1e-5, "micro-batch vs whole batch log-probs")


def test_suppressed_tokens_give_the_log_probs_of_the_sampling_distribution(tiny_model):
    """The engines never sample vision placeholders; with ``suppress`` the trainer's log-probs and entropy
    are those of the distribution with those tokens removed and the rest renormalised (float64 reference),
    and no gradient reaches the suppressed logits."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import vlrft.models  # noqa: F401
    from vlrft.rollout.base import vision_token_ids

    path = tiny_model("qwen2_5_vl")
    model, proc = AutoModelForImageTextToText.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)
    banned = torch.tensor(vision_token_ids(proc.tokenizer))
    assert banned.numel() == 5
    prompts = [encode_prompt(proc, PromptRecord(id="a", prompt="<image> colour?", images=[Image.new("RGB", (56, 56))]))]
    responses = [torch.tensor([11, 12, 13])]
    batch = collate_sequences(prompts, [0], responses, proc.tokenizer.pad_token_id)
    ids, _ = response_tensors(responses, proc.tokenizer.pad_token_id)
    got, entropy = response_logprobs(model, batch, ids, temperature=0.7, with_entropy=True, suppress=banned)
    plain, _ = response_logprobs(model, batch, ids, temperature=0.7)
    with torch.no_grad():
        logits = model(**model_inputs(batch)).logits.double() / 0.7
    logits[..., banned] = -float("inf")
    ref = logits.log_softmax(-1)
    p = prompts[0].input_ids.numel()
    # float32 log-softmax over ~1e3 logits against float64 on the same logits: a few ulps of log-probs of ~7
    # (~1e-6); the entropy sums 1e3 such terms (~1e-5)
    for j, tok in enumerate(responses[0].tolist()):
        row = ref[0, p + j - 1]
        assert_within(abs(got[0, j].item() - row[tok].item()), 1e-5, "suppressed: float32 log-prob vs float64")
        finite = row[torch.isfinite(row)]
        assert_within(abs(entropy[0, j].item() + (finite.exp() * finite).sum().item()), 1e-4, "suppressed entropy")
    assert (got - plain).abs().max() > 1e-4  # the placeholders carried probability mass: the check can fail
    got.sum().backward()
    head = model.get_output_embeddings().weight.grad
    assert head[banned].abs().max() == 0 and head.abs().max() > 0


def test_samples_jsonl_keeps_a_records_text_to_a_bound():
    """Issue 64, item 2: a record's prompt or answer of megabytes is kept to SAMPLE_TEXT_CHARS in samples.jsonl,
    the cut counted; short text and non-text values unchanged."""
    from vlrft.trainer.experience import SAMPLE_TEXT_CHARS, clip_text

    huge = "x" * (5 * 2**20)
    cut = clip_text(huge)
    assert cut == "x" * SAMPLE_TEXT_CHARS + f"... [{len(huge) - SAMPLE_TEXT_CHARS} more characters]"
    assert clip_text("red") == "red" and clip_text(None) is None and clip_text(["a"]) == ["a"]
