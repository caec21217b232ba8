"""The export of a trained model: its full state written with ``save_pretrained`` (safetensors), LoRA merged, so that
transformers and vLLM load it."""

from __future__ import annotations

import copy
import importlib
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch


def save_full_state(
    model: torch.nn.Module,
    state: dict[str, torch.Tensor],
    out_dir: str | Path,
    processor: Any,
    *,
    merge_lora: bool,
    wraps_in_deepspeed: bool,
) -> None:
    """Write ``model`` with its full ``state`` (a strategy's ``full_state_dict``) to ``out_dir`` with
    ``save_pretrained``, and ``processor`` beside it. ``merge_lora``: a peft model is exported merged (a copy loads
    ``state`` and ``merge_and_unload`` folds its adapters in). ``wraps_in_deepspeed``: whether the strategy wraps the
    model in a DeepSpeed engine (else accelerate is told there is none: :func:`_unwrap_without_deepspeed`)."""
    if hasattr(model, "merge_and_unload") and merge_lora:
        merged = copy.deepcopy(model)
        merged.load_state_dict(state)
        model, state = merged.merge_and_unload(), None
    with _unwrap_without_deepspeed(not wraps_in_deepspeed):
        model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    if processor is not None:
        processor.save_pretrained(out_dir)


@contextmanager
def _unwrap_without_deepspeed(active: bool) -> Iterator[None]:
    """transformers' ``save_pretrained`` unwraps the model through accelerate, which imports DeepSpeed (seconds of
    import, and its "Setting accelerator to CPU" line on stdout) whenever DeepSpeed is installed, only to test
    whether the model is a DeepSpeed engine. A strategy that wraps nothing in one tells accelerate there is none."""
    other = importlib.import_module("accelerate.utils.other")
    if not active or "deepspeed" in sys.modules or not hasattr(other, "is_deepspeed_available"):
        yield
        return
    saved = other.is_deepspeed_available
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = saved
