"""Scalar reward model (SRM): a Qwen(-VL) backbone with a linear head (no bias) that reads one reward per sequence.

The backbone is the base model that ``AutoModel`` builds from a Qwen-VL (or text Qwen) checkpoint:
``Qwen2_5_VLModel`` (vision encoder + language model) or ``Qwen2Model``; its final hidden states are
pooled and a ``Linear(hidden, 1, bias=False)`` head (``score``) gives the reward. Pooling:

- ``last_token``: the hidden state of the last non-padding token (the assistant turn's ``<|im_end|>``),
  as in InstructGPT/OpenRLHF reward models; left and right padding both work.
- ``attention``: softmax-weighted mean of the non-padding hidden states, weights from a learned
  ``Linear(hidden, 1)`` query (``pool_query``).

Saved folder (``save_pretrained``): the backbone in transformers' format (``config.json`` +
``model.safetensors``, so ``AutoModel.from_pretrained`` loads it), the head in
``reward_head.safetensors`` and ``vlrft_reward_head.json`` naming the head and its pooling, plus the
processor. ``ScalarRewardModel.from_pretrained(path)`` reloads it without any training state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from data_pipelines.collate import model_inputs
from reward_models.encoding import encode_responses
from vlrft.models.loading import load_model

HEAD_CONFIG = "vlrft_reward_head.json"
HEAD_WEIGHTS = "reward_head.safetensors"
POOLINGS = ("last_token", "attention")


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last non-padding token of each row (left or right padding)."""
    length = attention_mask.shape[1]
    return length - 1 - attention_mask.flip(1).to(torch.long).argmax(1)


class ScalarRewardModel(nn.Module):
    """``forward(**batch) -> rewards [B]`` from a backbone and a scalar head."""

    def __init__(self, backbone: nn.Module, pooling: str = "last_token", seed: int = 0):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.backbone = backbone
        self.config = backbone.config
        self.pooling = pooling
        hidden = backbone.config.get_text_config().hidden_size
        gen = torch.Generator().manual_seed(seed)
        # No bias: Bradley-Terry sees only reward differences, so a bias gets no gradient (only rounding
        # noise, which Adam would blow up to lr-sized steps). Init as OpenRLHF's value head: N(0, 1/(hidden+1)).
        self.score = nn.Linear(hidden, 1, bias=False)
        with torch.no_grad():
            self.score.weight.copy_(torch.randn(1, hidden, generator=gen) / (hidden + 1) ** 0.5)
        self.pool_query = nn.Linear(hidden, 1, bias=False) if pooling == "attention" else None
        if self.pool_query is not None:
            with torch.no_grad():
                self.pool_query.weight.zero_()  # starts as a plain mean over tokens
        self._no_split_modules = getattr(backbone, "_no_split_modules", None)
        self.score.to(next(backbone.parameters()).dtype)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_backbone(
        cls, path: str | Path, pooling: str = "last_token", dtype: torch.dtype | None = None, seed: int = 0
    ) -> ScalarRewardModel:
        """A new SRM (fresh head) on the backbone of a Qwen(-VL) checkpoint folder."""

        backbone, _ = load_model(path, dtype or torch.float32, lm_head=False, processor=False)
        return cls(backbone, pooling=pooling, seed=seed)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None) -> ScalarRewardModel:
        """Reload a folder written by :meth:`save_pretrained`."""

        path = Path(path)
        cfg_file = path / HEAD_CONFIG
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{path} is not a scalar reward model folder: {HEAD_CONFIG} is missing")
        head = json.loads(cfg_file.read_text())
        model = cls.from_backbone(path, pooling=head["pooling"], dtype=dtype)
        state = load_file(str(path / HEAD_WEIGHTS))
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith("backbone.")]
        if missing or unexpected:
            raise ValueError(f"{path / HEAD_WEIGHTS}: missing {missing}, unexpected {unexpected}")
        return model

    # -- forward --------------------------------------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, per_token: bool = False, **mm: Any
    ) -> torch.Tensor:
        """Rewards ``[B]``; with ``per_token`` the head on every position, ``[B, T]`` (a PPO critic's values)."""
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **mm)
        hidden = out.last_hidden_state
        if per_token:
            return self.score(hidden).squeeze(-1).float().clone()
        if self.pooling == "last_token":
            idx = last_token_index(attention_mask)
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), idx]
        else:
            logits = self.pool_query(hidden).squeeze(-1).float()
            logits = logits.masked_fill(attention_mask == 0, torch.finfo(logits.dtype).min)
            weights = torch.softmax(logits, dim=-1).to(hidden.dtype)
            pooled = torch.einsum("bt,bth->bh", weights, hidden)
        return self.score(pooled).squeeze(-1).float().clone()  # not a view (FSDP2 hooks the output)

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)

    def activation_checkpointing_enable(self, **kwargs: Any) -> None:
        self.backbone.activation_checkpointing_enable(**kwargs)

    # -- saving ---------------------------------------------------------------------------------
    def head_config(self) -> dict:
        return {
            "format": "vlrft_scalar_reward_model",
            "version": 1,
            "head": "score: Linear(hidden_size, 1, bias=False) on the pooled final hidden state",
            "pooling": self.pooling,
            "hidden_size": self.score.in_features,
            "backbone_class": type(self.backbone).__name__,
            "weights": HEAD_WEIGHTS,
        }

    def save_pretrained(
        self, out_dir: str | Path, state_dict: dict | None = None, processor: Any = None, **kwargs: Any
    ) -> Path:
        """Write the backbone (transformers format), the head and its config (and the processor).

        ``state_dict`` (e.g. a gathered full state dict from FSDP2/DeepSpeed) replaces the module's own.
        """

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = self.state_dict() if state_dict is None else state_dict
        backbone_sd = {k[len("backbone.") :]: v for k, v in state.items() if k.startswith("backbone.")}
        head_sd = {k: v.detach().to("cpu").contiguous() for k, v in state.items() if not k.startswith("backbone.")}
        self.backbone.save_pretrained(out, state_dict=backbone_sd, **kwargs)
        save_file(head_sd, str(out / HEAD_WEIGHTS))
        (out / HEAD_CONFIG).write_text(json.dumps(self.head_config(), indent=2) + "\n")
        if processor is not None:
            processor.save_pretrained(out)
        return out


@torch.no_grad()
def score_responses(
    model: ScalarRewardModel,
    processor: Any,
    items: list[tuple[str, list[Any], str, str | None]],
    micro_batch_size: int = 8,
    max_length: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Rewards ``[N]`` (float32, CPU) of ``(prompt, images, response, system)`` items, in micro-batches."""

    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(items), micro_batch_size):
        batch = encode_responses(processor, items[start : start + micro_batch_size], max_length)
        out.append(model(**model_inputs(batch, device)).float().cpu())
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0)
