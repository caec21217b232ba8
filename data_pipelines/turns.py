"""Multi-turn conversations with tools, in the model family's own format (the chat template decides,
``data_pipelines.templates.render``).

:func:`encode_observation` gives the tokens that follow a sampled assistant turn: the template's rendering of
the tool turn (``role: tool`` messages, their images as image parts) and of the next assistant header, found as
the difference between the conversation rendered with and without them, after the end-of-turn token the policy
sampled. So a trajectory ``prompt + sampled_1 + observation_1 + sampled_2 + ...`` is token for token what the
template gives for the whole conversation (tests/test_tools_format.py proves it with images in turns 2 and 3),
and only the sampled tokens are the policy's.
"""

from __future__ import annotations

from typing import Any

import torch

from data_pipelines.collate import EncodedPrompt, image_outputs, types_of
from data_pipelines.templates import render


def encode_observation(
    processor: Any,
    conversation: list[dict[str, Any]],
    observations: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    end_of_turn: str,
) -> EncodedPrompt:
    """The tokens after the last assistant turn of ``conversation`` (which the policy ended with the token
    ``end_of_turn``): the ``observations`` (``role: tool`` messages, image parts holding PIL images) and the next
    assistant header, with their images processed. Raises ``ValueError`` for a template that rewrites earlier
    turns (its rendering with the observations does not extend the one without)."""
    before = render(processor, conversation, tools=tools, add_generation_prompt=False, tokenize=False)
    after = render(processor, conversation + observations, tools=tools, add_generation_prompt=True, tokenize=False)
    if not after.startswith(before):
        raise ValueError("the chat template renders earlier turns differently once a tool turn follows")
    cut = before.rfind(end_of_turn)
    if cut < 0:
        raise ValueError(f"the template does not end an assistant turn with {end_of_turn!r}")
    text = after[cut + len(end_of_turn) :]
    images = [
        c["image"]
        for m in observations
        if isinstance(m["content"], list)
        for c in m["content"]
        if c.get("type") == "image"
    ]
    if getattr(processor, "image_processor", None) is None:
        ids = processor(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        return EncodedPrompt(ids.long())
    enc = processor(text=[text], images=images or None, return_tensors="pt")
    return EncodedPrompt(
        enc["input_ids"][0].long(), *image_outputs(enc), images=images, mm_token_type_ids=types_of(enc)
    )


def concat(parts: list[EncodedPrompt]) -> EncodedPrompt:
    """Encoded pieces of one sequence joined in order (ids, images, image marks)."""
    pv = [p.pixel_values for p in parts if p.pixel_values is not None]
    grids = [p.image_grid_thw for p in parts if p.image_grid_thw is not None]
    types = None
    if any(p.mm_token_type_ids is not None for p in parts):
        types = torch.cat(
            [p.mm_token_type_ids if p.mm_token_type_ids is not None else torch.zeros_like(p.input_ids) for p in parts]
        )
    return EncodedPrompt(
        torch.cat([p.input_ids for p in parts]),
        torch.cat(pv) if pv else None,
        torch.cat(grids) if grids else None,
        images=[im for p in parts for im in p.images],
        mm_token_type_ids=types,
    )
