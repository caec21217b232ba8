"""Response log-probs gathered from the response region equal a direct full-sequence computation."""

from __future__ import annotations

import torch
from PIL import Image

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
    for i, r in enumerate(responses):
        p = prompts[index[i]].input_ids.numel()
        for j, tok in enumerate(r.tolist()):
            expected = logp_all[i, p + j - 1, tok].item()  # logits at position t predict token t + 1
            assert abs(got[i, j].item() - expected) < 1e-5
            ent = -(logp_all[i, p + j - 1].exp() * logp_all[i, p + j - 1]).sum().item()
            assert abs(entropy[i, j].item() - ent) < 1e-4
    assert mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]

    # a micro-batch selected from the experience gives the same log-probs
    exp = Experience(batch, ids, mask, None, None, torch.zeros(3), torch.zeros(3, 4), torch.tensor(index))
    sub = exp.micro_batch(torch.tensor([2, 1]))
    assert sub["image_grid_thw"].shape[0] == 1  # only sample 2 has an image
    with torch.no_grad():
        again, _ = response_logprobs(model, sub, sub["response_ids"], temperature=temperature)
    assert torch.allclose(again[0, :2], got[2, :2], atol=1e-5) and torch.allclose(again[1, :1], got[1, :1], atol=1e-5)
