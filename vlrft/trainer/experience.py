"""From rollouts to training tensors: response log-probs, entropy, rewards, advantages.

Response tensors are laid out ``[N, R]`` (sample, response position), with a response mask; the
model itself sees right-padded prompt+response sequences (data_pipelines.collate). Only the logits of
the response region are computed (``logits_to_keep``) and only the response positions are gathered,
so a long prompt costs no vocabulary-sized activations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from data_pipelines.collate import EncodedPrompt, model_inputs
from data_pipelines.records import PromptRecord
from vlrft.algorithms import (
    compute_advantages,
    entropy_from_logits,
    filter_zero_variance_groups,
    logprobs_from_logits,
)
from vlrft.models.packing import (
    cached_prompt_logits,
    sample_images,
    shared_forward_kind,
    shared_prompt_logits,
    shared_prompt_values,
)
from vlrft.models.routing_replay import replaying
from vlrft.rollout import Rollout
from vlrft.rollout.generation import sample_rollouts
from vlrft.rollout.trajectories import tool_summary, turn_log
from vlrft.tracking import image_refs, video_refs

SAMPLE_TEXT_CHARS = 4000  # a record's prompt or answer as samples.jsonl keeps it


def clip_text(text: Any, limit: int = SAMPLE_TEXT_CHARS) -> Any:
    """``text`` cut to ``limit`` characters, the cut counted (``... [N more characters]``); other values as they are."""
    if not isinstance(text, str) or len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


@dataclass
class ScoredGroup:
    """One prompt and its sampled, scored responses: the row a rollout batch is made of (dynamic sampling
    keeps or drops whole groups; a group's position in the batch is its group id)."""

    record: PromptRecord
    prompt: EncodedPrompt
    rollouts: list[Rollout]  # its n samples (their ``prompt_index`` refers to the generate call)
    rewards: torch.Tensor  # [n] combined reward
    per_source: dict[str, torch.Tensor]  # source name -> [n]
    version: int | None = None  # the policy version that sampled it (rollout.mode=async; None: the current one)

    def varied(self) -> bool:
        """Not all rewards equal (DAPO's filter): the group carries a learning signal under a group baseline."""
        return filter_zero_variance_groups(self.rewards, [0] * len(self.rewards))[1] == 1


def group_rollouts(
    records: list[PromptRecord],
    prompts: list[EncodedPrompt],
    rollouts: list[Rollout],
    rewards: torch.Tensor,
    per_source: dict[str, torch.Tensor],
) -> list[ScoredGroup]:
    """Scored rollouts of one generate call (``prompt_index`` into ``records``/``prompts``) as groups."""
    members: list[list[int]] = [[] for _ in records]
    for j, x in enumerate(rollouts):
        members[x.prompt_index].append(j)
    out = []
    for rec, prompt, idx in zip(records, prompts, members):
        index = torch.tensor(idx, dtype=torch.long)
        out.append(
            ScoredGroup(
                rec, prompt, [rollouts[j] for j in idx], rewards[index], {k: v[index] for k, v in per_source.items()}
            )
        )
    return out


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
    groups: list[ScoredGroup] = field(default_factory=list)  # what the rows came from (sample logs)
    rollout_log_probs: torch.Tensor | None = None  # [N, R] the engine's own (vllm), for rollout correction
    teacher_log_probs: torch.Tensor | None = None  # [N, R] on-policy distillation's teacher (sample logs)

    def __len__(self) -> int:
        return int(self.response_ids.shape[0])

    def sample_rows(self, limit: int) -> list[dict[str, Any]]:
        """The first ``limit`` trajectories as log rows: prompt, answer, images, response, rewards, advantage (and
        of a multi-turn one its turns: text, calls, observations with their image counts). A record's prompt and
        answer are kept to :data:`SAMPLE_TEXT_CHARS` characters (the rest counted), so a huge record does not grow
        ``samples.jsonl`` by its size every step; responses are bounded by the token budget, tool observations by
        the tools' character cut (``vlrft.tools``)."""
        rows = [(g.record, x) for g in self.groups for x in g.rollouts][:limit]
        return [
            {
                "id": rec.id,
                "prompt": clip_text(rec.prompt),
                "answer": clip_text(rec.answer),
                "image": image_refs(rec.images),
                **({"video": video_refs(rec.videos)} if getattr(rec, "videos", None) else {}),
                "response": x.text,
                "finish_reason": x.finish_reason,
                "rewards": {k: float(v[i]) for k, v in self.per_source.items()},
                "reward": float(self.rewards[i]),
                "advantage": float(self.advantages[i, 0]) if self.advantages.shape[1] else 0.0,
                **(turn_log(x.trajectory) if x.trajectory is not None else {}),
                **self._distilled(i),
            }
            for i, (rec, x) in enumerate(rows)
        ]

    def _distilled(self, i: int) -> dict[str, Any]:
        """Sample ``i``'s per-token log-probs under the teacher and the student (its sampled tokens only), when a
        teacher scored it."""
        if self.teacher_log_probs is None or self.old_log_probs is None:
            return {}
        m = self.response_mask[i].bool()
        pick = lambda t: [round(float(v), 4) for v in t[i][m]]  # noqa: E731
        record = [g.record for g in self.groups for _ in g.rollouts][i]
        named = record.metadata.get("teacher")  # several teachers (teacher.by_name): the one that scored it
        return {
            **({"teacher": named} if named else {}),
            "teacher_logprobs": pick(self.teacher_log_probs),
            "student_logprobs": pick(self.old_log_probs),
        }

    def micro_batch(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """Samples ``index`` as a micro-batch (sequences re-collated to their own width)."""
        b = self.batch
        idx = index.tolist()
        width = int((b["prompt_lengths"][index] + b["response_lengths"][index]).max())
        out = {
            k: b[k][index][:, :width]
            for k in ("input_ids", "attention_mask", "action_mask", "mm_token_type_ids", "routing")
            if k in b
        }
        out["prompt_lengths"] = b["prompt_lengths"][index]
        if "prompt_index" in b:
            out["prompt_index"] = b["prompt_index"][index]
        out["response_lengths"] = b["response_lengths"][index]
        if "response_images" in b:
            out["response_images"] = b["response_images"][index]
        out.update(sample_images(b, idx))
        rlen = int(out["response_lengths"].max()) if len(idx) else 0
        out["response_ids"] = self.response_ids[index][:, :rlen]
        out["response_mask"] = self.response_mask[index][:, :rlen]
        out["advantages"] = self.advantages[index][:, :rlen]
        for name in ("old_log_probs", "ref_log_probs", "values", "returns", "rollout_log_probs"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value[index][:, :rlen]
        return out


# finite (an -inf logit would make the entropy's p * x NaN) and representable in fp16/bf16; exp(-1e4 - max)
# is 0 in float32, so the token has probability 0 and gets no gradient
SUPPRESSED_LOGIT = -1.0e4


def response_logits(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    width: int,
    *,
    device: torch.device | None = None,
    shared: bool = False,
    suppress: torch.Tensor | None = None,
    token_masks: list | None = None,
) -> torch.Tensor:
    """The logits ``[N, width, V]`` that predict each of the first ``width`` response tokens of ``batch`` (positions
    past a response's end hold junk: mask them). ``shared`` (with the batch's ``prompt_index``): each prompt computed
    once per group (vlrft.models.packing). ``suppress``: token ids the engines never sample
    (``vlrft.rollout.base.vision_token_ids``), their logits set to :data:`SUPPRESSED_LOGIT`, so these are the logits
    of the distribution the engine sampled from, not of one that keeps mass on tokens no rollout can contain.
    ``token_masks``: a list to which each forward of the model appends, in call order, a ``[rows, positions]`` mask of
    the positions of its input that hold the batch's response tokens (where the router's load-balancing loss of a
    mixture-of-experts policy is taken: ``vlrft.trainer.micro_losses``)."""
    device = device or next(model.parameters()).device
    r = width
    kind = shared_forward_kind(model, batch) if shared else None
    if kind == "packed":
        picked = shared_prompt_logits(model, batch, r, device, token_masks)  # [N, R, V]
    elif kind == "cached":
        picked = cached_prompt_logits(model, batch, r, device, token_masks)
    else:
        prompt_len = batch["prompt_lengths"].to(device)
        width = batch["input_ids"].shape[1]
        if token_masks is not None:
            token_masks.append(response_token_mask(batch, width))
        start = int(prompt_len.min()) - 1  # first position whose logits predict a response token
        out = model(**model_inputs(batch, device), logits_to_keep=width - start, use_cache=False)
        logits = out.logits  # [N, width - start, V]
        pos = (prompt_len - 1 - start)[:, None] + torch.arange(r, device=device)[None]  # [N, R]
        pos = pos.clamp(max=logits.shape[1] - 1)
        picked = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1]))  # [N, R, V]
    if suppress is not None and suppress.numel():
        picked = picked.index_fill(-1, suppress.to(device), SUPPRESSED_LOGIT)
    return picked


def response_token_mask(batch: dict[str, torch.Tensor], width: int) -> torch.Tensor:
    """``[N, width]``: at the positions of the plain rows ``[prompt | response | pad]`` that hold a response token, its
    ``response_mask`` (0 for a token the policy did not sample, e.g. a tool's observation); 0 elsewhere."""
    sampled = batch["response_mask"].float()
    out = torch.zeros(sampled.shape[0], width + sampled.shape[1])
    pos = batch["prompt_lengths"][:, None] + torch.arange(sampled.shape[1])[None]
    lengths = batch["response_lengths"][:, None]
    out.scatter_(1, pos, sampled * (torch.arange(sampled.shape[1])[None] < lengths))
    return out[:, :width]


def response_logprobs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    response_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    device: torch.device | None = None,
    shared: bool = False,
    suppress: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[N, R]`` of ``response_ids`` under ``model`` (temperature as in sampling), and the
    token entropy ``[N, R]`` when asked, from :func:`response_logits` (``shared``, ``suppress`` as there). Positions
    past a response's end hold junk: mask them."""
    picked = response_logits(model, batch, response_ids.shape[1], device=device, shared=shared, suppress=suppress)
    return logprobs_and_entropy(picked, response_ids, temperature, with_entropy)


def logprobs_and_entropy(
    logits: torch.Tensor, response_ids: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-probs of ``response_ids`` and (asked) the entropy of response logits ``[N, R, V]``."""
    logp = logprobs_from_logits(logits, response_ids.to(logits.device), temperature=temperature)
    entropy = entropy_from_logits(logits, temperature=temperature) if with_entropy else None
    return logp, entropy


def response_values(
    critic: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    width: int,
    device: torch.device | None = None,
    shared: bool = False,
) -> torch.Tensor:
    """A critic's values ``[N, width]`` of the states before each response token (a
    ``ScalarRewardModel`` called with ``per_token=True``): value j is read at position prompt_len - 1 + j.
    ``shared``: each prompt computed once per group, as in :func:`response_logprobs`."""
    device = device or next(critic.parameters()).device
    if shared and shared_forward_kind(critic, batch) == "packed":  # a recurrent critic: its plain rows
        return shared_prompt_values(critic, batch, width, device)
    values = critic(**model_inputs(batch, device), per_token=True)  # [N, T]
    pos = (batch["prompt_lengths"].to(device) - 1)[:, None] + torch.arange(width, device=device)[None]
    return values.gather(1, pos.clamp(max=values.shape[1] - 1))


@torch.no_grad()
def infer_response_logprobs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    response_ids: torch.Tensor,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
    shared: bool = False,
    suppress: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`response_logprobs` of every sample of ``batch`` (old or reference log-probs), without gradient
    in eval mode, ``micro_batch_size`` at a time; ``[N, R]`` float32 on CPU (past each response: the log-probs of the
    padding tokens, meaningless; the response mask drops them)."""

    def part_logprobs(part: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = part["response_ids"]
        with replaying(model, part):  # rollout routing replay (the update replays in PolicyTrainer.train_on)
            return response_logprobs(model, part, ids, temperature=temperature, shared=shared, suppress=suppress)[0]

    return _infer(model, batch, response_ids, micro_batch_size, part_logprobs)


@torch.no_grad()
def infer_response_values(
    critic: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    response_ids: torch.Tensor,
    *,
    micro_batch_size: int,
    shared: bool = False,
) -> torch.Tensor:
    """:func:`response_values` of a critic for every sample of ``batch``, like :func:`infer_response_logprobs`."""
    return _infer(
        critic,
        batch,
        response_ids,
        micro_batch_size,
        lambda part: response_values(critic, part, part["response_ids"].shape[1], shared=shared),
    )


def samples_of_batch(batch: dict[str, torch.Tensor], response_ids: torch.Tensor) -> Experience:
    """A collated batch and its responses as an :class:`Experience` with nothing computed yet, for its
    :meth:`~Experience.micro_batch` (any subset of samples re-collated, their images and videos with them)."""
    n = response_ids.shape[0]
    return Experience(
        batch=batch,
        response_ids=response_ids,
        response_mask=torch.ones_like(response_ids),
        old_log_probs=None,
        ref_log_probs=None,
        rewards=torch.zeros(n),
        advantages=torch.zeros(response_ids.shape),
        group_ids=torch.zeros(n),
    )


def _infer(model, batch, response_ids, micro_batch_size, forward) -> torch.Tensor:
    was = model.training
    model.eval()
    n = response_ids.shape[0]
    whole = samples_of_batch(batch, response_ids)
    out = torch.zeros(response_ids.shape, dtype=torch.float32)
    for start in range(0, n, micro_batch_size):
        idx = torch.arange(start, min(start + micro_batch_size, n))
        scores = forward(whole.micro_batch(idx))
        out[idx, : scores.shape[1]] = scores.float().cpu()
    model.train(was)
    return out


def global_advantages(
    strategy: Any,
    algorithm: Any,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: torch.Tensor,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns (``algorithm``: the ``algorithm`` config section) computed on the batch of
    all ranks, batch-level statistics included, then this rank's rows taken back; groups never span
    ranks, so every rank computes the same global result."""
    s = strategy
    parts = s.all_gather_object((rewards, mask, group_ids, values))
    width = max(p[1].shape[1] for p in parts)
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
    offset = sum(len(p[0]) for p in parts[: s.rank])
    all_r = torch.cat([pad(p[0]) if p[0].dim() == 2 else p[0] for p in parts])
    all_m = torch.cat([pad(p[1]) for p in parts])
    all_g = torch.cat([p[2] + rank * 1_000_000 for rank, p in enumerate(parts)])
    all_v = torch.cat([pad(p[3]) for p in parts]) if values is not None else None
    adv, ret = compute_advantages(
        algorithm.advantage_estimator,
        all_r,
        all_m,
        group_ids=all_g,
        values=all_v,
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        std_normalization=algorithm.std_normalization or None,
    )
    rows = slice(offset, offset + len(rewards))
    return adv[rows, : mask.shape[1]], ret[rows, : mask.shape[1]]


def rollout_metrics(
    rewards: torch.Tensor,
    per_source: dict[str, torch.Tensor],
    accuracy_source: str | None,
    group_ids: torch.Tensor,
    rollouts: list[Rollout],
) -> dict[str, float]:
    """What a rollout batch looked like: mean rewards (combined and per source), accuracy (the share of
    samples whose ``accuracy_source`` score is > 0.5), response lengths, the share of groups without
    reward variance."""
    lengths = torch.tensor([float(x.response_ids.numel()) for x in rollouts])
    out = {"reward/combined": float(rewards.mean())}
    out.update({f"reward/{k}": float(v.mean()) for k, v in per_source.items()})
    if accuracy_source in per_source:
        out["accuracy"] = float((per_source[accuracy_source] > 0.5).float().mean())
    out["response_length/mean"] = float(lengths.mean())
    out["response_length/clip_ratio"] = sum(x.finish_reason == "length" for x in rollouts) / len(rollouts)
    _, kept = filter_zero_variance_groups(rewards, group_ids)
    out["frac_reward_zero_std"] = 1.0 - kept / max(1, len(set(group_ids.tolist())))
    return out


def advantage_metrics(advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    on_response = advantages[mask.bool()]
    if not mask.any():
        return {"advantages/mean": 0.0, "advantages/abs_mean": 0.0}
    return {"advantages/mean": float(on_response.mean()), "advantages/abs_mean": float(on_response.abs().mean())}


def response_tensors(
    responses: list[torch.Tensor], pad_id: int, action_masks: list[torch.Tensor | None] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, R]`` padded response ids and their mask: 1 on the tokens the policy sampled (every response token, or
    where given a trajectory's ``action_mask``: tool observations and template tokens are not trained)."""
    r = max(1, max(x.numel() for x in responses))
    ids = torch.full((len(responses), r), pad_id, dtype=torch.long)
    mask = torch.zeros((len(responses), r), dtype=torch.long)
    for i, x in enumerate(responses):
        ids[i, : x.numel()] = x
        given = action_masks[i] if action_masks is not None else None
        mask[i, : x.numel()] = given if given is not None else 1
    return ids, mask


def draw_groups(
    engine: Any,
    processor: Any,
    records: list[PromptRecord],
    sampling: Any,
    cfg: Any,
    pool: Any,
    trajectories: Any,
    metrics: dict[str, float],
    keys: list[int] | None = None,
) -> list[ScoredGroup]:
    """``records`` sampled by ``engine`` (``keys``: keyed sampling, one per record) and scored by ``pool``, as groups:
    what a colocated trainer and an async rollout rank (``vlrft.trainer.async_rl``) both do. ``cfg``: the policy
    config (its ``data`` and ``tools`` sections); the tools' and the pool's figures are added to ``metrics``."""
    data = cfg.data
    prompts, rollouts = sample_rollouts(
        engine,
        processor,
        records,
        sampling,
        system_prompt=data.system_prompt or None,
        prompt_template=data.prompt_template,
        trajectories=trajectories,
        keys=keys,
    )
    if trajectories is not None:
        metrics.update(tool_summary([{**turn_log(x.trajectory), "finish_reason": x.finish_reason} for x in rollouts]))
    t0 = time.perf_counter()
    combined, per_source, pool_metrics = score_rollouts(pool, records, rollouts, cfg.tools)
    metrics["time/reward"] = metrics.get("time/reward", 0.0) + time.perf_counter() - t0
    metrics.update({(k if k.startswith("time/") else f"reward_pool/{k}"): v for k, v in pool_metrics.items()})
    return group_rollouts(records, prompts, rollouts, combined, per_source)


def score_rollouts(
    pool: Any, records: list[PromptRecord], rollouts: list[Rollout], tools: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """The pool's rewards of one generate call's rollouts (``prompt_index`` into ``records``): combined, per source
    and the pool's metrics. A trajectory's sources see its whole conversation (``Sample.trajectory``; the response
    is its last turn), and each of its calls adds ``tools.call_reward`` (ran) or ``tools.error_reward`` (failed)."""
    recs = [records[r.prompt_index] for r in rollouts]
    trajs = [r.trajectory for r in rollouts]
    multi = any(t is not None for t in trajs)
    out = pool.score(
        recs, [r.text for r in rollouts], trajectories=[t.messages if t else None for t in trajs] if multi else None
    )
    combined, metrics = out.combined.float(), dict(out.metrics)
    if multi and (tools.call_reward or tools.error_reward):
        bonus = torch.tensor(
            [
                tools.call_reward * sum(t.calls.values()) + tools.error_reward * sum(t.errors.values()) if t else 0.0
                for t in trajs
            ]
        )
        combined = combined + bonus
        metrics["reward/tool_calls"] = float(bonus.mean())
    return combined, {k: v.float() for k, v in out.per_source.items()}, metrics
