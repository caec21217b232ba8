"""Disaggregated placement (``rollout.mode: async``): which ranks of a torchrun world sample rollouts and which train,
and the channels between them.

torchrun starts ``WORLD_SIZE`` processes with one command, on one machine or several (its usual ``--nnodes`` /
``--rdzv_*`` flags). With ``rollout.asynchronous.rollout_ranks: K`` the first ``K / nnodes`` local ranks of every node
are rollout ranks (so a two-node job has rollout ranks on both sides of the node boundary) and the others train. The
split is made before any process group exists, from torchrun's own store:

- the trainer ranks form the default process group among themselves (``init_process_group`` on a prefix of the
  store, ranks renumbered 0..M-1, ``RANK`` / ``WORLD_SIZE`` set to those), so the strategies, checkpoints, liveness
  and evaluation see a world of M trainers and nothing else changes for them;
- a rollout rank joins no default group: it runs as one process (``WORLD_SIZE=1``) with the policy's copy, its
  engine and the reward pool;
- :attr:`Placement.channel`, a gloo group over the whole world, carries the scored rollouts from rollout to trainer
  ranks (pickled objects, point to point);
- :attr:`Placement.publish`, a group of the first trainer and every rollout rank (NCCL on GPUs, gloo on CPUs),
  carries the versioned weights, by broadcast.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from vlrft.config import ConfigError
from vlrft.errors import DistributedError
from vlrft.liveness import LivenessMonitor
from vlrft.strategies.process import mark_in_groups

# what a header broadcast on the publish group announces
WEIGHTS, STOP = 1, 2


def rollout_rank_set(world: int, local_world: int, rollout_ranks: int) -> list[int]:
    """The global ranks that sample: the first ``rollout_ranks / nodes`` local ranks of each node (torchrun numbers a
    node's ranks contiguously, ``local_world`` per node). Raises ConfigError naming the rule."""
    nodes = max(1, world // max(1, local_world))
    if world < 2:
        raise ConfigError(
            "rollout.mode=async: needs a torchrun world of at least 2 processes (rollout ranks sample, the others "
            "train), this one has 1; run torchrun --nproc_per_node 2 -m vlrft train-policy ..."
        )
    if rollout_ranks < 1 or rollout_ranks >= world:
        raise ConfigError(
            f"rollout.asynchronous.rollout_ranks={rollout_ranks}: must lie in 1..{world - 1} for a torchrun world of "
            f"{world} processes (at least one rank trains)"
        )
    if rollout_ranks % nodes:
        raise ConfigError(
            f"rollout.asynchronous.rollout_ranks={rollout_ranks}: must be a multiple of the {nodes} nodes "
            "(each node gets as many rollout ranks)"
        )
    per_node = rollout_ranks // nodes  # < local_world: rollout_ranks < world
    return [node * local_world + i for node in range(nodes) for i in range(per_node)]


@dataclass
class Placement:
    """This process's place in an async job and its channels (built by :func:`place`)."""

    role: str  # "trainer" or "rollout"
    rank: int  # torchrun's global rank
    world: int
    rollout_ranks: list[int]
    trainer_ranks: list[int]
    channel: Any  # gloo group over the whole world: scored rollouts, point to point (global ranks)
    publish: Any | None  # the first trainer and the rollout ranks: versioned weights (None on other trainers)
    hosts: dict[int, str] = field(default_factory=dict)  # global rank -> host name
    timeout_s: float = 1800.0

    @property
    def is_rollout(self) -> bool:
        return self.role == "rollout"

    @property
    def rollout_index(self) -> int:
        return self.rollout_ranks.index(self.rank)

    @property
    def trainer_index(self) -> int:
        return self.trainer_ranks.index(self.rank)

    def where(self, rank: int) -> str:
        """``rank N on HOST`` for a global rank, as error lines name it."""
        return f"rank {rank} on {self.hosts.get(rank, '?')}"

    def watch(self, folder: Path, timeout_s: float) -> LivenessMonitor | None:
        """Heartbeats of every rank of the world, trainers and rollout ranks, in ``folder`` (``vlrft.liveness``): a
        rank killed or silent for ``timeout_s`` stops every other with one line naming it and its host. Every rank
        calls it (the start waits for all at the channel's barrier); None with ``timeout_s=0``."""
        if timeout_s <= 0:
            return None
        monitor = LivenessMonitor(folder, self.rank, self.world, timeout_s)
        monitor.start(lambda: self.channel.barrier().wait())
        return monitor

    # --- objects, point to point on the channel -------------------------------------------------------------
    def send_object(self, obj: Any, dst: int) -> list[Any]:
        """Send ``obj`` (pickled) to global rank ``dst`` without waiting; returns the pending works, which must be
        kept (with their buffers) until done."""
        payload = torch.frombuffer(bytearray(dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        return [(self.channel.send([size], dst, 0), size), (self.channel.send([payload], dst, 1), payload)]

    def recv_object(self, src: int, what: str) -> Any:
        """The next object global rank ``src`` sent; a rank that is gone or silent past the timeout is one line
        naming it and ``what`` was awaited (:class:`DistributedError`)."""
        size = torch.zeros(1, dtype=torch.int64)
        self._wait(self.channel.recv([size], src, 0), src, what)
        payload = torch.empty(int(size), dtype=torch.uint8)
        self._wait(self.channel.recv([payload], src, 1), src, what)
        return pickle.loads(memoryview(payload.numpy()))

    # --- the publish group ------------------------------------------------------------------------------------
    def broadcast_header(self, kind: int, version: int, count: int = 0) -> tuple[int, int, int]:
        """The first trainer announces ``(kind, version, count)``; every member returns what was announced."""
        header = torch.tensor([kind, version, count], dtype=torch.int64, device=self._publish_device)
        self._broadcast(header, "the header of the next weights")
        return int(header[0]), int(header[1]), int(header[2])

    def broadcast_tensors(self, tensors: Iterable[torch.Tensor], what: str) -> None:
        """Broadcast each tensor from the first trainer (in place on the receivers)."""
        for t in tensors:
            self._broadcast(t, what)

    @property
    def _publish_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if _nccl() else torch.device("cpu")

    def broadcast_async(self, tensor: torch.Tensor) -> Any:
        """Broadcast ``tensor`` from the first trainer over the publish group; returns the pending work (the first
        trainer goes on without waiting for the receivers; keep the tensor until the work is done)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self.publish.broadcast([tensor], opts)

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        self._wait(self.broadcast_async(tensor), self.trainer_ranks[0], what)

    def _wait(self, work: Any, peer: int, what: str) -> None:
        try:
            work.wait()
        except Exception as exc:  # the transport's error: a closed connection (a killed rank) or the timeout
            text = str(exc)
            closed = any(k in text for k in ("Connection closed", "Connection reset", "Broken pipe"))
            why = (
                "is gone (its connection closed: killed or crashed)"
                if closed
                else f"sent nothing for {self.timeout_s:g} s"
            )
            me = f"{'rollout' if self.is_rollout else 'trainer'} {self.where(self.rank)}"
            raise DistributedError(f"{self._role(peer)} {self.where(peer)} {why}; {me} awaited {what}") from None

    def _role(self, rank: int) -> str:
        return "rollout" if rank in self.rollout_ranks else "trainer"


def _tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor rebuilt from :func:`dumps`' bytes (its own, writable memory)."""
    t = torch.empty(shape, dtype=getattr(torch, dtype))
    if t.numel():
        t.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return t


def _reduce_tensor(t: torch.Tensor) -> tuple:
    """Pickle a plain CPU tensor as its bytes, dtype and shape: a step's rollouts hold thousands of small tensors, which
    torch's own reduction (a storage object each) pickles about 10 times slower."""
    if t.device.type != "cpu" or t.requires_grad or t.is_sparse or t.is_quantized:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    c = t.detach().contiguous()
    data = c.view(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
    return _tensor, (data, str(c.dtype).removeprefix("torch."), tuple(c.shape))


def dumps(obj: Any) -> bytes:
    """``obj`` pickled, its CPU tensors by :func:`_reduce_tensor` (what :meth:`Placement.send_object` sends)."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}
    pickler.dump(obj)
    return buf.getvalue()


def _nccl() -> bool:
    return torch.cuda.is_available() and dist.is_nccl_available()


def place(rollout_ranks: int, timeout_s: float) -> Placement:
    """Split torchrun's world (see the module docstring); on a trainer rank the default process group of the trainers
    exists afterwards (when there are several), and ``RANK`` / ``WORLD_SIZE`` say the trainers' numbering. Called once,
    before the strategy is built."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    rollouts = rollout_rank_set(world, local_world, rollout_ranks)
    trainers = [r for r in range(world) if r not in rollouts]
    timeout = timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    mark_in_groups()
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    channel = dist.ProcessGroupGloo(dist.PrefixStore("vlrft-async/channel", store), rank, world, timeout)
    members = [trainers[0], *rollouts]
    publish = None
    if rank in members:
        prefix = dist.PrefixStore("vlrft-async/publish", store)
        if _nccl():
            publish = dist.ProcessGroupNCCL(prefix, members.index(rank), len(members), dist.ProcessGroupNCCL.Options())
        else:
            publish = dist.ProcessGroupGloo(prefix, members.index(rank), len(members), timeout)
    store.set(f"vlrft-async/host/{rank}", socket.gethostname())
    hosts = {r: store.get(f"vlrft-async/host/{r}").decode() for r in range(world)}
    role = "rollout" if rank in rollouts else "trainer"
    p = Placement(role, rank, world, rollouts, trainers, channel, publish, hosts, timeout_s)
    if role == "trainer":
        index = p.trainer_index
        os.environ.update(RANK=str(index), WORLD_SIZE=str(len(trainers)))
        if len(trainers) > 1:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            prefix = dist.PrefixStore("vlrft-async/trainers", store)
            dist.init_process_group(backend, store=prefix, rank=index, world_size=len(trainers), timeout=timeout)
    else:
        os.environ.update(RANK="0", WORLD_SIZE="1")
    return p
