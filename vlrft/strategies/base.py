"""The training-strategy seam: one small interface, implementations registered by name (``vlrft.strategies.registry``).

A strategy owns the distributed set-up, wraps model and optimizer, and does backward, optimizer step
(with gradient clipping and the LR schedule), collectives, exact checkpoint save/load and the
full-state export. Trainers call only these methods, so the same loop runs on one CPU process, under
``torchrun`` with gloo, or on a GPU cluster. The parts a strategy builds on live beside it: its config
(``config.py``), the process set-up (``process.py``), the optimizer (``optim.py``), the model's adaptation for training
(``adapt.py``, ``blocks.py``), the non-finite checks (``numerics.py``), the weight stream (``weight_stream.py``) and
the export (``export.py``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.distributed as dist

from vlrft.checkpoints import atomic_dir, commit_dir
from vlrft.errors import NonFiniteError
from vlrft.strategies.adapt import adapt_for_device, adapt_for_training
from vlrft.strategies.config import OptimConfig, StrategyConfig
from vlrft.strategies.export import save_full_state
from vlrft.strategies.numerics import adamw_zero_over_zero, any_nonfinite, local_tensor
from vlrft.strategies.optim import make_optimizer, make_scheduler
from vlrft.strategies.process import init_distributed, keep_freed_memory
from vlrft.strategies.weight_stream import stream_full_params


class Strategy:
    """Base class: distributed set-up, collectives, model preparation shared by all strategies. An implementation
    registers with :func:`~vlrft.strategies.registry.register_strategy`, which sets ``name``."""

    name: ClassVar[str] = ""  # what strategy.name selects (set by @register_strategy)
    wraps_in_deepspeed: ClassVar[bool] = False  # the model is wrapped in a DeepSpeed engine (export asks)

    def __init__(self, cfg: StrategyConfig, optim: OptimConfig | None = None):
        self.cfg = cfg
        self.optim_cfg = optim or OptimConfig()
        self.rank, self.world_size = init_distributed(timeout_s=cfg.timeout_s)
        self.last_step_skipped = False  # the last step() changed nothing (a non-finite quantity)
        self.nonfinite_quantity: str | None = None  # the first non-finite quantity of that step
        self._loss_nonfinite: torch.Tensor | bool = False  # on the device: no sync per micro-batch
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        if cfg.keep_freed_memory == "yes" or (cfg.keep_freed_memory == "auto" and self.device.type == "cpu"):
            keep_freed_memory()
        self.model = self.optimizer = self.scheduler = None

    # --- distributed helpers -------------------------------------------------------------------
    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def shards_parameters(self) -> bool:
        """True when a rank holds only part of the parameters (generation must then run in lockstep)."""
        return False

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """All-reduce a copy of ``tensor`` ('mean', 'sum' or 'max'); identity on one process."""
        if not self.distributed:
            return tensor
        out = tensor.detach().clone().to(self.device)
        dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        if op == "mean":
            out /= self.world_size
        return out.to(tensor.device)

    def all_gather_object(self, obj: Any) -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    # --- model preparation shared by all strategies --------------------------------------------
    def _prepared(self, model: torch.nn.Module, trainable: bool) -> torch.nn.Module:
        """What every strategy does to a model before placing and wrapping it: training mode, LoRA, freezing and
        checkpointing (:func:`~vlrft.strategies.adapt.adapt_for_training`) where it trains; the policy's kernels
        (:meth:`compute_like_policy`, frozen models too)."""
        model = adapt_for_training(model, self.cfg) if trainable else model
        return self.compute_like_policy(model)

    def compute_like_policy(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make ``model`` compute as the strategy's models do on its device (their CPU products' kernels:
        :func:`~vlrft.strategies.adapt.adapt_for_device`): every model it prepares, and models it does not wrap,
        the reward pool's say. Returns the model, changed in place."""
        return adapt_for_device(model, self.cfg, self.device)

    def _with_optimizer(self, model: torch.nn.Module, total_steps: int, trainable: bool):
        """Frozen eval model, or the model with its AdamW and LR schedule (torch-native strategies)."""
        if not trainable:
            model.eval().requires_grad_(False)
            return model, None, None
        self.model = model
        self.optimizer = make_optimizer(model.parameters(), self.optim_cfg)
        self.scheduler = make_scheduler(self.optimizer, self.optim_cfg, total_steps)
        return self.model, self.optimizer, self.scheduler

    def _check_loss(self, loss: torch.Tensor) -> None:
        """Remember a non-finite loss of this optimizer step (its gradients are not applied)."""
        self._loss_nonfinite = ~torch.isfinite(loss.detach()).all() | self._loss_nonfinite

    def _agree(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank."""
        return bool(self.all_reduce(torch.tensor(float(flag)), "max")) if self.distributed else flag

    def _clip_and_step(self) -> float:
        """Global-norm clipping, optimizer and scheduler step (torch-native strategies).

        The non-finite guard: a step whose loss or global gradient norm is not finite, or whose AdamW
        update would divide zero by zero (``optim.eps=0`` with a zero gradient element and no second
        moment), is skipped on every rank: gradients zeroed, no optimizer or scheduler step, so
        parameters and optimizer state (moments, step count) stay exactly as they were."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor, the norm over all shards
            norm = norm.full_tensor()
        quantity = None
        if self._agree(bool(self._loss_nonfinite)):
            quantity = "loss"
        elif not math.isfinite(float(norm)):
            quantity = "grad_norm"
        elif self._agree(self.optim_cfg.eps == 0 and adamw_zero_over_zero(self.optimizer)):
            quantity = "optimizer_update (optim.eps=0 divides a zero moment by zero)"
        self._loss_nonfinite = False
        self.last_step_skipped, self.nonfinite_quantity = quantity is not None, quantity
        if quantity is None:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if quantity is None:
            self.require_finite_weights("after the optimizer step")
        return float(norm)

    def _local_weights(self) -> Iterator[torch.Tensor]:
        """This rank's share of the trained parameters (FSDP2: its shard; ZeRO-3 overrides this)."""
        for p in self.unwrap().parameters():
            yield local_tensor(p.detach())

    def require_finite_weights(self, where: str) -> None:
        """Raise :class:`NonFiniteError` (on every rank) when any trained parameter is NaN or infinite:
        nothing non-finite is ever written, and a run whose weights became so stops at once."""
        if self._agree(any_nonfinite(list(self._local_weights()))):
            raise NonFiniteError(
                f"model parameters are NaN or infinite {where} (optim.lr={self.optim_cfg.lr}, "
                f"optim.eps={self.optim_cfg.eps}); nothing was written. Lower optim.lr, keep optim.eps > 0, "
                "or resume from the last checkpoint"
            )

    def _save_atomically(self, path: str | Path, write) -> None:
        """All ranks ``write(tmp_dir)`` into a fresh ``.tmp`` sibling of ``path``; rank 0 then renames it
        into place with a COMPLETE marker. A crash at any point leaves the previous checkpoints intact."""
        final = Path(path)
        tmp = final.with_name(final.name + ".tmp")
        self.require_finite_weights(f"when saving checkpoint {final}")
        if self.is_rank0:
            atomic_dir(final)
        self.barrier()
        write(tmp)
        self.barrier()
        if self.is_rank0:
            commit_dir(tmp, final)
        self.barrier()

    # --- interface -----------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module, total_steps: int = 1, trainable: bool = True):
        """Wrap ``model`` (and build its optimizer and scheduler when ``trainable``)."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor, last_micro_batch: bool = True) -> None:
        """Accumulate gradients of ``loss``; pass ``last_micro_batch=False`` for all but the last
        micro-batch of an optimizer step (DeepSpeed reduces across ranks at that boundary)."""
        raise NotImplementedError

    def step(self) -> float:
        """Clip gradients, step optimizer and scheduler, zero gradients; returns the global grad norm."""
        raise NotImplementedError

    @property
    def train_module(self) -> torch.nn.Module:
        """What the training forward calls: the prepared model (DeepSpeed: its engine)."""
        return self.model

    def unwrap(self, model: torch.nn.Module | None = None) -> torch.nn.Module:
        """The underlying ``nn.Module`` (for forward, generate and export)."""
        return model if model is not None else self.model

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) model state on CPU; complete on rank 0 (may be empty elsewhere)."""
        raise NotImplementedError

    def full_params(
        self, *, trainable_only: bool = False, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The trained model's full parameters, one ``(Hugging Face name, tensor)`` at a time, on every
        rank: what a rollout engine with its own copy of the weights loads after each update (vLLM's
        ``load_weights`` takes this stream). LoRA is merged in (``W + scaling * B @ A``, peft's formula)
        under the base model's names; the adapters themselves are not yielded. Sharded strategies gather
        collectively, so every rank must consume the whole stream, and a tensor is valid until the next one is
        drawn (it may alias the live parameters, or a gathered buffer that is freed after it: copy one to keep it).
        ``trainable_only``: skip frozen parameters (a frozen vision tower) that an engine already holds;
        LoRA-wrapped base weights are still sent, merged. ``dtype``: what the caller casts every tensor to (its
        engine's weights); a strategy whose gathers cast to that dtype anyway (FSDP2's bf16 mixed precision) may
        then stream in it, bitwise the caller's own cast. None: the parameters' dtype."""
        yield from stream_full_params(
            self.unwrap(), self._gathered_groups, self._full_tensor, trainable_only=trainable_only, dtype=dtype
        )

    def _gathered_groups(
        self, model: torch.nn.Module, sent: Callable[[str, torch.nn.Parameter], bool], dtype: torch.dtype | None
    ) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
        """``model``'s parameters that ``sent`` keeps, in groups, in the same order on every rank. A sharded strategy
        may gather a group's parameters together (one collective), whole while the caller reads that group; here
        one group, each parameter made whole by :meth:`_full_tensor` as it is read."""
        yield [(name, param) for name, param in model.named_parameters() if sent(name, param)]

    def _full_tensor(self, param: torch.nn.Parameter) -> torch.Tensor:
        """One parameter in full (sharded strategies gather it)."""
        return param.detach()

    def save_checkpoint(self, path: str | Path, client_state: dict[str, Any]) -> None:
        """Save model, optimizer, scheduler and ``client_state`` atomically to ``path`` (exact resume)."""
        raise NotImplementedError

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote; returns the client state."""
        raise NotImplementedError

    def save_pretrained(self, out_dir: str | Path, processor: Any = None) -> None:
        """Export the model with ``save_pretrained`` (safetensors) so transformers (and vLLM) load it;
        refused (:class:`NonFiniteError`) when a weight is not finite."""
        self.require_finite_weights(f"when exporting to {out_dir}")
        state = self.full_state_dict()
        if self.is_rank0:
            save_full_state(
                self.unwrap(),
                state,
                out_dir,
                processor,
                merge_lora=self.cfg.lora_rank > 0,
                wraps_in_deepspeed=self.wraps_in_deepspeed,
            )
        self.barrier()

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else 0.0
