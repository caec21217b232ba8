"""From rollouts to training tensors: response log-probs, entropy, rewards, advantages.

Response tensors are laid out ``[N, R]`` (sample, response position), with a response mask; the
model itself sees right-padded prompt+response sequences (data_pipelines.collate). Only the logits of
the response region are computed (``logits_to_keep``) and only the response positions are gathered,
so a long prompt costs no vocabulary-sized activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from data_pipelines.collate import model_inputs
from vlrft.algorithms import entropy_from_logits, logprobs_from_logits


@dataclass
class Experience:
    """One rollout batch on this rank, ready for policy updates."""

    batch: dict[str, torch.Tensor]  # collated prompt+response sequences (data_pipelines.collate)
    response_ids: torch.Tensor  # [N, R]
    response_mask: torch.Tensor  # [N, R] 1 on response tokens
    old_log_probs: torch.Tensor | None  # [N, R] (None: single on-policy pass, the current policy's own)
    ref_log_probs: torch.Tensor | None  # [N, R] (None: no KL term)
    rewards: torch.Tensor  # [N] combined reward
    advantages: torch.Tensor  # [N, R]
    group_ids: torch.Tensor  # [N]
    per_source: dict[str, torch.Tensor] = field(default_factory=dict)
    values: torch.Tensor | None = None  # [N, R] critic values at rollout time (PPO with a critic)
    returns: torch.Tensor | None = None  # [N, R] GAE returns, the critic's targets

    def __len__(self) -> int:
        return int(self.response_ids.shape[0])

    def select(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """Samples ``index`` as a micro-batch (sequences re-collated to their own width)."""
        b = self.batch
        idx = index.tolist()
        width = int((b["prompt_lengths"][index] + b["response_lengths"][index]).max())
        out = {k: b[k][index][:, :width] for k in ("input_ids", "attention_mask", "action_mask")}
        out["prompt_lengths"] = b["prompt_lengths"][index]
        out["response_lengths"] = b["response_lengths"][index]
        if "pixel_values" in b:
            out.update(_select_images(b, idx))
        rlen = int(out["response_lengths"].max()) if len(idx) else 0
        out["response_ids"] = self.response_ids[index][:, :rlen]
        out["response_mask"] = self.response_mask[index][:, :rlen]
        out["advantages"] = self.advantages[index][:, :rlen]
        for name in ("old_log_probs", "ref_log_probs", "values", "returns"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value[index][:, :rlen]
        return out


def _select_images(batch: dict[str, torch.Tensor], idx: list[int]) -> dict[str, torch.Tensor]:
    grid, per_sample = batch["image_grid_thw"], batch["images_per_sample"].tolist()
    patch_counts = grid.prod(-1).tolist()
    img_start = [0]
    for c in per_sample:
        img_start.append(img_start[-1] + c)
    patch_start = [0]
    for c in patch_counts:
        patch_start.append(patch_start[-1] + c)
    rows, grids = [], []
    for i in idx:
        a, b = img_start[i], img_start[i + 1]
        if b > a:
            rows.append(batch["pixel_values"][patch_start[a] : patch_start[b]])
            grids.append(grid[a:b])
    if not rows:
        return {}
    return {
        "pixel_values": torch.cat(rows),
        "image_grid_thw": torch.cat(grids),
        "images_per_sample": batch["images_per_sample"][idx],
    }


def response_logprobs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    response_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[N, R]`` of ``response_ids`` under ``model`` (temperature as in sampling), and the
    token entropy ``[N, R]`` when asked. Positions past a response's end hold junk: mask them."""
    device = device or next(model.parameters()).device
    prompt_len = batch["prompt_lengths"].to(device)
    width = batch["input_ids"].shape[1]
    r = response_ids.shape[1]
    start = int(prompt_len.min()) - 1  # first position whose logits predict a response token
    out = model(**model_inputs(batch, device), logits_to_keep=width - start, use_cache=False)
    logits = out.logits  # [N, width - start, V]
    pos = (prompt_len - 1 - start)[:, None] + torch.arange(r, device=device)[None]  # [N, R]
    pos = pos.clamp(max=logits.shape[1] - 1)
    picked = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1]))  # [N, R, V]
    logp = logprobs_from_logits(picked, response_ids.to(device), temperature=temperature)
    entropy = entropy_from_logits(picked, temperature=temperature) if with_entropy else None
    return logp, entropy


def response_values(
    critic: torch.nn.Module, batch: dict[str, torch.Tensor], width: int, device: torch.device | None = None
) -> torch.Tensor:
    """A critic's values ``[N, width]`` of the states before each response token (a
    ``ScalarRewardModel`` called with ``per_token=True``): value j is read at position prompt_len - 1 + j."""
    device = device or next(critic.parameters()).device
    values = critic(**model_inputs(batch, device), per_token=True)  # [N, T]
    pos = (batch["prompt_lengths"].to(device) - 1)[:, None] + torch.arange(width, device=device)[None]
    return values.gather(1, pos.clamp(max=values.shape[1] - 1))


@torch.no_grad()
def score_responses(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    response_ids: torch.Tensor,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
    values: bool = False,
) -> torch.Tensor:
    """:func:`response_logprobs` (or, with ``values``, :func:`response_values` of a critic) for all
    samples of ``batch``, ``micro_batch_size`` at a time, in eval mode and without gradient; ``[N, R]``
    float32 on CPU (zeros past each response's end)."""
    was = model.training
    model.eval()
    n = response_ids.shape[0]
    whole = Experience(
        batch,
        response_ids,
        torch.ones_like(response_ids),
        None,
        None,
        torch.zeros(n),
        torch.zeros(response_ids.shape),
        torch.zeros(n),
    )
    out = torch.zeros(response_ids.shape, dtype=torch.float32)
    for start in range(0, n, micro_batch_size):
        idx = torch.arange(start, min(start + micro_batch_size, n))
        part = whole.select(idx)
        if values:
            scores = response_values(model, part, part["response_ids"].shape[1])
        else:
            scores, _ = response_logprobs(model, part, part["response_ids"], temperature=temperature)
        out[idx, : scores.shape[1]] = scores.float().cpu()
    model.train(was)
    return out


def response_tensors(responses: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, R]`` padded response ids and their mask."""
    r = max(1, max(x.numel() for x in responses))
    ids = torch.full((len(responses), r), pad_id, dtype=torch.long)
    mask = torch.zeros((len(responses), r), dtype=torch.long)
    for i, x in enumerate(responses):
        ids[i, : x.numel()] = x
        mask[i, : x.numel()] = 1
    return ids, mask
