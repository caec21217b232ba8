"""Rollout routing replay (R3: Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers", arXiv 2510.11370): the training forward of a mixture-of-experts policy routes each token to the
experts the rollout chose, so that a near tie between two experts' router logits, decided one way by the engine's
numerics and the other way by the trainer's, no longer changes the token's log-prob between the two.

:func:`record_routing` keeps, during the rollout's forwards (``generate``'s prefill and decode steps), the top-k
experts each MoE layer chose at every position; :func:`replay_routing` makes the MoE layers of a later forward route
each token to given experts. The gating weights stay the current router's: softmax over its logits, taken at the
replayed experts and renormalised to sum to 1 as these architectures do for their own top-k (no ``norm_topk_prob``
switch: Qwen3.5-MoE and Qwen3-VL-MoE always renormalise), so the router's weights get their gradient. Both hook the
router (``vlrft.models.moe.on_routing``), so every expert implementation transformers dispatches to is unchanged.

Positions: a router sees its block's tokens ``[B, S]`` flattened row-major, so both work in the layout of the
forward's own ``input_ids``: a rollout's ``[B, prompt width + steps]`` (left-padded prompts), a training forward's
``[N, width]`` (right-padded ``[prompt | response | pad]``; the plain path of ``vlrft.trainer.experience``, not the
group-shared packed rows). :func:`sequence_routing` turns the first into one sample's positions.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from vlrft.models.moe import RouterCall, capture_routing, moe_blocks, on_routing

NOT_RECORDED = -1  # an expert index that replays nothing: the router chooses the token's experts itself


@dataclass
class RoutingRecord:
    """The experts of the forwards run under :func:`record_routing` so far (taken, and cleared, by :meth:`take`)."""

    num_layers: int
    calls: list[RouterCall] = field(default_factory=list)

    def take(self) -> torch.Tensor:
        """The experts ``[B, positions, L, k]`` (int16, on CPU) of the forwards since the last take, their positions
        concatenated in call order: ``generate``'s prefill then one per decode step (the last sampled token is never
        fed back: no position holds it). A forward over fewer rows that divide the later ones (the hf engine's
        prefill once per prompt, then its n samples) is expanded to them, each row repeated for its n samples. The
        forwards of one ``generate`` call only: take after each (the hf engine generates a micro-batch per call)."""
        calls = list(self.calls)
        self.calls.clear()
        if not calls:
            return torch.zeros((0, 0, self.num_layers, 0), dtype=torch.int16)
        forwards = [calls[i : i + self.num_layers] for i in range(0, len(calls), self.num_layers)]
        steps = []
        for fwd in forwards:
            if [c.layer for c in fwd] != list(range(self.num_layers)):
                raise ValueError(f"routing record: a forward's router calls came from layers {[c.layer for c in fwd]}")
            rows, positions = fwd[0].shape
            steps.append(torch.stack([c.experts.reshape(rows, positions, -1) for c in fwd], dim=2))
        for before, after in zip(steps, steps[1:]):
            # a new prompt batch: more positions after a one-position decode step, or fewer rows than before
            if (before.shape[1] == 1 < after.shape[1]) or after.shape[0] % before.shape[0]:
                raise ValueError(
                    f"routing record: a forward over {tuple(after.shape[:2])} (rows, positions) after one over "
                    f"{tuple(before.shape[:2])}: the forwards of several generate calls; take() after each"
                )
        rows = steps[-1].shape[0]
        steps = [step.repeat_interleave(rows // step.shape[0], dim=0) for step in steps]
        return torch.cat(steps, dim=1).to(torch.int16).cpu()


@contextmanager
def record_routing(model: torch.nn.Module) -> Iterator[RoutingRecord]:
    """Within the block, the experts every MoE layer of ``model`` routes each token to, kept by forward (the router
    logits are not kept: a rollout's would be large)."""
    record = RoutingRecord(len(moe_blocks(model)))
    with capture_routing(model, logits=False) as calls:
        record.calls = calls
        yield record


def sequence_routing(
    recorded: torch.Tensor, prompt_width: int, prompt_lengths: list[int], response_lengths: list[int]
) -> list[torch.Tensor]:
    """Each sample's experts ``[prompt length + response length, L, k]`` in its own positions ``[prompt |
    response]``, from a ``generate`` record ``recorded`` (:meth:`RoutingRecord.take`) over left-padded prompts
    ``prompt_width`` wide; the last response token, which no rollout forward saw, holds :data:`NOT_RECORDED`."""
    out = []
    for row, (p, r) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        seq = torch.full((p + r, *recorded.shape[2:]), NOT_RECORDED, dtype=recorded.dtype)
        seen = recorded[row, prompt_width - p : prompt_width + max(r - 1, 0)]
        seq[: seen.shape[0]] = seen
        out.append(seq)
    return out


@dataclass
class ReplayCount:
    """What :func:`replay_routing` replayed: (token, layer) routings given, and of those the ones the router itself
    would have sent to other experts (compared as sets)."""

    routed: int = 0
    flipped: int = 0

    @property
    def flip_share(self) -> float:
        return self.flipped / max(self.routed, 1)


@contextmanager
def replay_routing(model: torch.nn.Module, experts: torch.Tensor) -> Iterator[ReplayCount]:
    """Within the block, every forward of ``model`` over tokens ``[B, S]`` routes the token at ``(b, s)`` of MoE layer
    l to ``experts[b, s, l]`` (``[B, S, L, k]``; a row of :data:`NOT_RECORDED` leaves that token's routing to the
    router), weighted by the current router's softmax at those experts, renormalised: the router's weight gets its
    gradient. Run the backward inside the block too where activation checkpointing recomputes the forward there.
    Yields the count of replayed routings and of those the router would have chosen otherwise (a recomputed forward
    counts again)."""
    num_layers = len(moe_blocks(model))
    if experts.dim() != 4 or experts.shape[2] != num_layers:
        raise ValueError(f"replay_routing: experts of shape {tuple(experts.shape)}, not [B, S, {num_layers}, top_k]")

    def replay(layer: int, shape: tuple[int, int], output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        logits, _, chosen = output
        if tuple(experts.shape[:2]) != shape or experts.shape[3] != chosen.shape[-1]:
            raise ValueError(
                f"replay_routing: experts of shape {tuple(experts.shape)} for a forward over {shape} tokens with "
                f"top-{chosen.shape[-1]} routing"
            )
        given = experts[:, :, layer].reshape(chosen.shape).to(chosen.device, torch.long)
        use = torch.where(given >= 0, given, chosen)
        seen = given[:, 0] >= 0
        count.routed += int(seen.sum())
        count.flipped += int(((use.sort(-1).values != chosen.sort(-1).values).any(-1) & seen).sum())
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top = probs.gather(-1, use)
        return logits, (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype), use

    count = ReplayCount()
    with on_routing(model, replay):
        yield count


def collate_routing(routings: list[torch.Tensor], width: int) -> torch.Tensor:
    """The samples' experts (``Rollout.routing``, each ``[its length, L, k]``) as one ``[N, width, L, k]`` tensor in
    the layout of the training rows ``[prompt | response | pad]`` (``data_pipelines.collate.collate_sequences``),
    :data:`NOT_RECORDED` past each sample."""
    shapes = {tuple(r.shape[1:]) for r in routings}
    if len(shapes) != 1:
        raise ValueError(f"routing of samples with different (layers, top_k): {sorted(shapes)}")
    out = torch.full((len(routings), width, *shapes.pop()), NOT_RECORDED, dtype=routings[0].dtype)
    for i, r in enumerate(routings):
        out[i, : r.shape[0]] = r[:width]
    return out


def replaying(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> AbstractContextManager:
    """:func:`replay_routing` of the batch's recorded experts (``batch["routing"]``, :func:`collate_routing`
    trimmed with the batch) in ``model``'s forwards, or nothing where the batch carries none."""
    return replay_routing(model, batch["routing"]) if "routing" in batch else nullcontext(None)
