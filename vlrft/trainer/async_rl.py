"""Asynchronous RL (``rollout.mode: async``, docs/async.md): rollout ranks sample and score while trainer ranks train.

The protocol, over the channels of :mod:`vlrft.strategies.placement`:

1. At the first step (after any resume), the first trainer sends every rollout rank the start: the model folder, the
   step, the prompt stream's cursor and the number of steps. Each rollout rank loads the model and answers with its
   parameters' names, shapes and dtypes: the layout of the weights it will receive.
2. Versioned weights: version ``v`` is the policy after ``v`` updates. The trainers publish the starting version, then
   version ``s + 1`` after step ``s`` (every trainer reads ``Strategy.full_params()``, sharded strategies gather; the
   first trainer broadcasts a header ``(WEIGHTS, v)`` and one flat buffer per dtype, without waiting for the
   receivers). A rollout rank loads versions in order, only when it needs them; with partial rollouts
   (``rollout.asynchronous.partial``) also as they arrive, between two decode steps (below).
3. Bounded staleness: rollout rank ``k`` samples step ``s`` with version ``max(start, s - max_staleness)``: never
   older (it waits for that version), never newer (the same tokens on every run: the staleness is exactly
   ``max_staleness`` after the first steps). It takes step ``s``'s prompts from the same seeded stream as the
   trainers, samples prompts ``i`` with ``i % K == k`` (keyed sampling: the tokens do not depend on which rank
   samples), scores them with the reward pool, and sends trainer ``t`` the groups ``i`` with ``i % M == t`` (the share
   a colocated run of M ranks gives rank ``t``), each group carrying its version, without waiting.

   Partial rollouts: the rank keeps a receive of the next header posted after every load, and the engine asks
   (:attr:`HFRolloutEngine.between_steps`) between decode steps whether it has arrived; a version that has is loaded
   in place there and the rest of the responses are drawn by it (``Rollout.versions``: each token's version; the KV
   cache of the tokens before stays as the older weights computed it, and each token's reported log-prob is that of
   the distribution it was drawn from, so the decoupled objective's behaviour policy is exactly the mixed one). A
   group's version is then its oldest token's: the staleness bound holds for every token (they are never older than
   the version the step needed, and never newer than the trainers' latest). Keyed sampling keeps each token a
   function of its key and the weights that drew it, but when a version lands depends on timing: a partial run is
   not reproducible (with ``max_staleness: 0`` no version can land mid-step, so lockstep stays bitwise).
4. The trainer of step ``s`` receives its groups from every rollout rank, checks that they are the prompts its own
   stream drew and that no group is older than ``max_staleness``, and trains (:class:`AsyncRollouts` in
   ``PolicyTrainer.make_experience``). The proximal policy is the one about to be updated (its log-probs from the
   update's own forward in a step of one update); ``algorithm.off_policy: decoupled`` weighs by proximal / behaviour.
5. At the end, or when the trainers stop early (preemption, an error), the first trainer broadcasts ``STOP``; a rollout
   rank reads it when it next needs weights (with partial rollouts: as it arrives, then finishes the step's
   generation without sending it) and ends. Samples in flight are discarded: a resumed run samples those steps
   again, from the checkpoint's version.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from vlrft.rollout.base import sampling_key
from vlrft.sampling import PromptStream
from vlrft.strategies.placement import STOP, WEIGHTS, Placement

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


def stream_layout(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """What a rollout rank receives: its parameters' (name, shape, dtype), in the order the buffers carry them."""
    return [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]


def empty_buffers(layout: list[tuple[str, tuple[int, ...], str]], device: torch.device) -> list[torch.Tensor]:
    """One flat buffer per dtype of ``layout`` (in its order of first appearance): what a version travels as."""
    out = []
    for dtype in dict.fromkeys(d for _, _, d in layout):
        numel = sum(int(torch.Size(shape).numel()) for _, shape, d in layout if d == dtype)
        out.append(torch.empty(numel, dtype=_DTYPES[dtype], device=device))
    return out


def buffer_views(
    layout: list[tuple[str, tuple[int, ...], str]], buffers: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Each parameter of ``layout`` as a view of its place in :func:`empty_buffers`' buffers (in the layout's order
    within its dtype's buffer): the one place the offsets are computed, for filling and for loading."""
    by_dtype = dict(zip(dict.fromkeys(d for _, _, d in layout), buffers))
    offsets = dict.fromkeys(by_dtype, 0)
    views = {}
    for name, shape, dtype in layout:
        n = int(torch.Size(shape).numel())
        views[name] = by_dtype[dtype][offsets[dtype] : offsets[dtype] + n].view(shape)
        offsets[dtype] += n
    return views


@torch.no_grad()
def flat_buffers(
    layout: list[tuple[str, tuple[int, ...], str]],
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    device: torch.device,
) -> list[torch.Tensor]:
    """The named tensors as one flat buffer per dtype of ``layout`` (in its order), cast to the receiver's dtypes.
    ``tensors``: a mapping, or a stream of ``(name, tensor)`` (``Strategy.full_params()``: each tensor is copied, and
    cast, once, straight into its place, as it streams); names outside ``layout`` are passed over, a name of ``layout``
    that never comes is a ``RuntimeError``."""
    buffers = empty_buffers(layout, device)
    views, filled = buffer_views(layout, buffers), set()
    for name, t in tensors.items() if isinstance(tensors, Mapping) else tensors:
        if name in views:
            views[name].copy_(t)
            filled.add(name)
    missing = sorted(set(views) - filled)
    if missing:
        raise RuntimeError(f"async weights: the trained model streams no {missing[0]!r} ({len(missing)} missing)")
    return buffers


@torch.no_grad()
def load_buffers(model: torch.nn.Module, layout, buffers: list[torch.Tensor]) -> None:
    """Copy :func:`flat_buffers`' content into ``model``'s parameters."""
    params = dict(model.named_parameters())
    for name, view in buffer_views(layout, buffers).items():
        params[name].copy_(view)


class AsyncRollouts:
    """The trainer's side: start the rollout ranks, receive each step's groups, publish each version, stop them."""

    def __init__(self, placement: Placement, cfg: Any, strategy: Any):
        self.p, self.cfg, self.strategy = placement, cfg, strategy
        self.max_staleness = cfg.rollout.asynchronous.max_staleness
        self.started = False
        self.layout: list | None = None
        self.pending: collections.deque = collections.deque()  # (works, buffers) of published versions in flight
        self.stopped = False
        self.liveness = Path(cfg.train.output_dir) / ".liveness" / "async"  # every rank's heartbeat, global ranks
        self.monitor = None

    # ------------------------------------------------------------------------------------------------ start / stop
    def start(self, model_path: str, step: int, cursor: int, total_steps: int) -> None:
        """Tell the rollout ranks where the run starts and publish the weights of version ``step``."""
        p = self.p
        if p.publish is not None:  # the first trainer
            hello = {"model_path": model_path, "step": step, "cursor": cursor, "total_steps": total_steps}
            works = [w for k in p.rollout_ranks for w in p.send_object(hello, k)]
            layouts = [p.recv_object(k, "its weight layout (the model loaded)") for k in p.rollout_ranks]
            for w, _ in works:
                w.wait()
            self.layout = layouts[0]
        self.monitor = p.watch(self.liveness, self.cfg.strategy.heartbeat_timeout_s)
        self.started = True
        self.publish(step)

    def publish(self, version: int) -> float:
        """Publish the trained weights as ``version`` (every trainer reads the stream; the first broadcasts it without
        waiting for the receivers, keeping at most ``max_staleness + 1`` versions in flight). Returns the seconds."""
        if not self.started:
            return 0.0
        t0 = time.perf_counter()
        s, p = self.strategy, self.p
        if p.publish is None:
            if s.shards_parameters:  # the gathers are collective: every trainer reads the whole stream
                for _ in s.full_params():
                    pass
            return time.perf_counter() - t0
        buffers = flat_buffers(self.layout, s.full_params(), p._publish_device)
        while len(self.pending) > self.max_staleness:
            self._wait_oldest()
        header = torch.tensor([WEIGHTS, version, len(buffers)], dtype=torch.int64, device=p._publish_device)
        works = [p.broadcast_async(header), *(p.broadcast_async(b) for b in buffers)]
        self.pending.append((works, [header, *buffers]))
        return time.perf_counter() - t0

    def _wait_oldest(self) -> None:
        works, _ = self.pending.popleft()
        for w in works:
            self.p._wait(w, self.p.rollout_ranks[0], "receipt of the published weights")

    def stop(self) -> None:
        """End the rollout ranks (the first trainer broadcasts STOP; the versions in flight are read first)."""
        try:
            self._stop()
        finally:
            if self.monitor is not None:
                self.monitor.stop()

    def _stop(self) -> None:
        if not self.started or self.stopped or self.p.publish is None:
            self.stopped = True
            return
        self.stopped = True
        header = torch.tensor([STOP, -1, 0], dtype=torch.int64, device=self.p._publish_device)
        self.pending.append(([self.p.broadcast_async(header)], [header]))
        while self.pending:
            self._wait_oldest()

    # ------------------------------------------------------------------------------------------------ receive
    def receive(self, step: int, records: list[Any], metrics: dict[str, float]) -> list[Any]:
        """This trainer's groups of step ``step`` from every rollout rank, in the order of ``records`` (its share of the
        step's prompts, as its own stream drew them; the groups come without their records, which are attached here)."""
        p = self.p
        t0 = time.perf_counter()
        messages = [p.recv_object(k, f"the rollouts of step {step + 1}") for k in p.rollout_ranks]
        wait = time.perf_counter() - t0
        indexed = sorted((x for m in messages for x in m["groups"]), key=lambda x: x[0])
        got, want = [rid for _, rid, _ in indexed], [r.id for r in records]
        if got != want or any(m["step"] != step for m in messages):
            raise RuntimeError(
                f"async step {step + 1}: the rollout ranks sent prompts {got[:4]} of steps "
                f"{sorted({m['step'] + 1 for m in messages})}, the trainer's stream drew {want[:4]}"
            )
        groups = [replace(g, record=r) for (_, _, g), r in zip(indexed, records)]
        lag = torch.tensor([float(step - g.version) for g in groups])  # a group's version: its oldest token's
        if lag.numel() and int(lag.max()) > self.max_staleness:
            raise RuntimeError(
                f"async step {step + 1}: a group of version {step - int(lag.max())} is "
                f"{int(lag.max())} updates old (rollout.asynchronous.max_staleness={self.max_staleness})"
            )
        tokens, mixed = token_staleness(groups, step)
        metrics["async/wait_rollouts_s"] = wait
        metrics["async/staleness_mean"] = float(lag.mean()) if lag.numel() else 0.0
        metrics["async/staleness_max"] = float(lag.max()) if lag.numel() else 0.0
        for k in range(self.max_staleness + 1):  # the histogram: share of groups (and of tokens) k updates old
            at = lag == k
            metrics[f"async/staleness_share/{k}"] = float(at.float().mean()) if lag.numel() else 0.0
            metrics[f"async/tokens_at_staleness/{k}"] = float(tokens.get(k, 0))
        metrics["async/partial_share"] = mixed  # samples whose tokens more than one version drew
        rollout_side = collections.defaultdict(list)
        for m in messages:
            for key, value in m["metrics"].items():
                rollout_side[key].append(value)
        metrics.update({k: float(sum(v) / len(v)) for k, v in rollout_side.items()})
        metrics["async/data_age_s"] = max(time.time() - m["sent_at"] for m in messages)
        return groups


def token_staleness(groups: list[Any], step: int) -> tuple[dict[int, int], float]:
    """Response tokens per version lag at ``step`` (``step - version``: each token's own where its rollout carries
    ``versions``, partial rollouts; else its group's), and the share of samples whose tokens carry more than one
    version."""
    tokens: dict[int, int] = collections.Counter()
    samples = mixed = 0
    for g in groups:
        for x in g.rollouts:
            samples += 1
            if x.versions is not None and x.versions.numel():
                lags, counts = torch.unique(step - x.versions, return_counts=True)
                tokens.update({int(k): int(c) for k, c in zip(lags, counts)})
                mixed += int(x.versions.min() != x.versions.max())
            else:
                tokens[step - g.version] += x.response_ids.numel()
    return tokens, mixed / max(samples, 1)


def oldest_version(rollouts: list[Any], fallback: int) -> int:
    """The version of a group's oldest token (``Rollout.versions``), or ``fallback`` (the one version that drew them
    all) where the rollouts carry none."""
    drawn = [int(x.versions.min()) for x in rollouts if x.versions is not None and x.versions.numel()]
    return min(drawn) if drawn else fallback


class RolloutWorker:
    """A rollout rank's loop (:func:`serve_rollouts`): weights in, scored groups out."""

    def __init__(
        self,
        placement: Placement,
        cfg: Any,
        model: torch.nn.Module,
        draw: Any,
        records: list,
        hello: dict,
        engine: Any = None,
    ):
        """``draw(records, keys, step, metrics) -> list[ScoredGroup]``: sample and score (the colocated trainer's own
        ``draw_groups``); ``records``: the training prompts, as the trainers read them; ``engine``: the engine
        ``draw`` samples with, kept in step with every version loaded into ``model`` where it has weights of its own
        (an inference copy), and given the hook of partial rollouts (``rollout.asynchronous.partial``)."""
        self.p, self.cfg, self.model, self.draw, self.engine = placement, cfg, model, draw, engine
        self.layout = stream_layout(model)
        self.version = -1
        self.stream = PromptStream(records, cfg.data.group_size, cfg.train.seed)
        self.stream.cursor = hello["cursor"]
        self.start, self.total = hello["step"], hello["total_steps"]
        self.pending: list = []  # sends in flight (works and their buffers)
        self.sending = {"async/rollout_send_s": 0.0, "async/message_mb": 0.0}  # the previous step's sends
        self.device = next(model.parameters()).device
        self.partial = cfg.rollout.asynchronous.partial
        self.posted: tuple[Any, torch.Tensor] | None = None  # partial: the posted receive of the next header
        self.stopped = False  # STOP read
        self.loaded_mid = 0  # partial: versions loaded between decode steps during the current step
        if self.partial:
            if engine is None or not hasattr(engine, "between_steps"):
                raise ValueError(
                    "rollout.asynchronous.partial=true: the rollout rank's engine must load versions between decode "
                    f"steps (HFRolloutEngine.between_steps); got {type(engine).__name__}"
                )
            engine.between_steps = self.between_steps

    def _next_weights(self) -> bool:
        """Read the next announcement, waiting for it: load a version (True) or STOP (False)."""
        p = self.p
        if self.stopped:
            return False
        if self.posted is None:
            kind, version, _ = p.broadcast_header(0, 0)
        else:  # partial: the receive posted after the last load
            (work, header), self.posted = self.posted, None
            p._wait(work, p.trainer_ranks[0], "the header of the next weights")
            kind, version = int(header[0]), int(header[1])
        if kind == STOP:
            self.stopped = True
            return False
        buffers = empty_buffers(self.layout, p._publish_device)
        p.broadcast_tensors(buffers, f"the weights of version {version}")
        load_buffers(self.model, self.layout, [b.to(self.device) for b in buffers])
        if self.engine is not None and self.engine.owns_weights:  # an inference copy generates: it loads them too
            self.engine.update_weights(self.model.named_parameters())
        self.version = version
        if self.partial:
            header = torch.zeros(3, dtype=torch.int64, device=p._publish_device)
            self.posted = (p.broadcast_async(header), header)
        return True

    def between_steps(self) -> int:
        """The engine's hook of partial rollouts (``HFRolloutEngine.between_steps``): load, in place, every version
        whose header has arrived (the first trainer sent its weights with it), note a STOP (the generation then
        finishes and the step ends unsent); returns the version loaded."""
        while self.posted is not None and self.posted[0].is_completed():
            if self._next_weights():
                self.loaded_mid += 1
        return self.version

    def run(self) -> None:
        p, a = self.p, self.cfg.rollout.asynchronous
        k, K, M = p.rollout_index, len(p.rollout_ranks), len(p.trainer_ranks)
        B = self.cfg.rollout.rollout_batch_size
        for step in range(self.start, self.total):
            t0 = time.perf_counter()
            while self.version < max(self.start, step - a.max_staleness):
                if not self._next_weights():
                    return
            idle = time.perf_counter() - t0
            picked = self.stream.take(B)
            mine = [(i, r) for i, r in enumerate(picked) if i % K == k]
            metrics: dict[str, float] = {}
            t1 = time.perf_counter()
            keys = [sampling_key(self.cfg.train.seed, step, r.id) for _, r in mine]
            version, self.loaded_mid = self.version, 0
            groups = self.draw([r for _, r in mine], keys, step, metrics)  # partial: versions may land meanwhile
            busy = time.perf_counter() - t1
            if self.stopped:  # partial: STOP arrived mid-generation; the trainers read nothing more
                return
            for g in groups:
                g.version = oldest_version(g.rollouts, version)
            samples = sum(len(g.rollouts) for g in groups)
            metrics.update(self.sending)
            metrics["async/rollout_idle_share"] = idle / max(idle + busy + self.sending["async/rollout_send_s"], 1e-9)
            metrics["async/rollout_samples_per_s"] = samples / max(busy, 1e-9)
            metrics["async/version"] = float(version)
            if self.partial:
                metrics["async/partial_loads"] = float(self.loaded_mid)
            self.pending = [(w, buf) for w, buf in self.pending if not w.is_completed()]
            t2, sent = time.perf_counter(), 0
            for t in range(M):
                # the record itself stays home (its images): the trainer's own stream drew the same one
                share = [(i, r.id, replace(g, record=None)) for (i, r), g in zip(mine, groups) if i % M == t]
                msg = {"step": step, "groups": share, "metrics": metrics, "sent_at": time.time()}
                works = p.send_object(msg, p.trainer_ranks[t])
                sent += sum(buf.numel() * buf.element_size() for _, buf in works)
                self.pending += works
            # what the trainers read with the next step's groups (this step's own figures went with them)
            self.sending = {"async/rollout_send_s": time.perf_counter() - t2, "async/message_mb": sent / M / 2**20}
        while self._next_weights():  # versions published after the last step sampled, until STOP
            pass


def async_sampling(sampling: Any) -> Any:
    """A rollout rank's sampling: the engine reports each drawn token's log-prob (the behaviour policy's)."""
    return replace(sampling, logprobs=True)
