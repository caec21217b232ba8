"""Tools and a reward of your own for multi-turn rollouts (docs/tools.md), loaded by path:

    tools: {names: [zoom, examples/tools/my_tools.py:mirror]}
    reward: {sources: [..., {name: right_region, kind: function, function: examples/tools/my_tools.py:right_region}]}

A tool is a plain function: its arguments are what the policy writes in the call, and ``images`` (the images of the
conversation so far, full resolution, PIL) is given when the signature asks for it. It returns text, a PIL image, a
list of those, or {"text": ..., "images": [...]}. Its schema (what the system turn lists) is its ``schema`` attribute,
or the one transformers derives from type hints and a Google-style docstring, as below.
"""

from __future__ import annotations

from PIL import ImageOps


def mirror(image: int, images: list) -> list:
    """Mirror an image left to right.

    Args:
        image: which image of the conversation, 1 for the first
    """
    if not 1 <= image <= len(images):
        raise ValueError(f"there is no image {image}")  # the policy sees the error and the call is counted
    return [f"image {image}, mirrored", ImageOps.mirror(images[image - 1].convert("RGB"))]


def right_region(sample) -> float:
    """1 when the trajectory's first tool call zooms into the region that holds the mark (synthetic:mark_color):
    a reward that reads the whole trajectory (``sample.trajectory``); with weight 0 it is a metric,
    ``reward/right_region``, the share of trajectories that looked in the right place."""
    for message in sample.trajectory or []:
        if message["role"] == "assistant":
            text = "".join(part.get("text", "") for part in message["content"])
            return float(f'"region": "{sample.metadata["region"]}"' in text)
    return 0.0
