"""DeepSpeed ZeRO-1/2/3 (gloo on CPU, NCCL on GPUs).

Gradient accumulation stays under the trainer's control: losses arrive already normalised by the
global token count, so ``backward`` does not rescale by the accumulation steps, and ``step`` marks the
accumulation boundary itself.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from vlrft.errors import KnownError
from vlrft.strategies.base import Strategy
from vlrft.strategies.blocks import transformer_blocks
from vlrft.strategies.optim import make_optimizer, make_scheduler
from vlrft.strategies.registry import register_strategy
from vlrft.strategies.weight_stream import params_by_unit

# A build of one of DeepSpeed's ops (the CPU shared-memory communicator, minutes at most on 2 cores) holds
# ``<extensions>/<op>/lock`` while it compiles; a build killed mid-way leaves it, and every later build of that
# op then waits on it forever, idle and silent. Older than this, no build is running.
STALE_BUILD_LOCK_S = 20 * 60


def check_build_locks(root: str | Path | None = None) -> None:
    """Stop with one message naming a stale build lock of torch's extensions folder (``TORCH_EXTENSIONS_DIR``,
    or torch's default) instead of waiting on it forever."""
    if root is None:
        from torch.utils.cpp_extension import _get_build_directory  # torch's rule for the folder (env or default)

        root = _get_build_directory("", False)  # the root itself: no op's folder is made
    now = time.time()
    for lock in sorted(Path(root).glob("*/lock")):
        try:
            age = now - lock.stat().st_mtime
        except OSError:  # released while we looked
            continue
        if age > STALE_BUILD_LOCK_S:
            raise KnownError(
                f"{lock} is a build lock {age / 60:.0f} minutes old (a build of DeepSpeed's op {lock.parent.name!r} "
                f"killed mid-way; a build holds it for minutes at most): every DeepSpeed run would wait on it "
                f"forever. Remove it (rm {lock}) if no build is running, and run again"
            )


@register_strategy("deepspeed")
class DeepSpeedStrategy(Strategy):
    wraps_in_deepspeed = True

    def __init__(self, cfg, optim=None):
        import deepspeed

        check_build_locks()
        super().__init__(cfg, optim)
        if self.distributed or not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        self.ds_engine = None

    @property
    def shards_parameters(self) -> bool:
        return self.distributed and self.cfg.zero_stage == 3

    def _ds_config(self, trainable: bool) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.cfg.zero_stage if trainable else (3 if self.cfg.zero_stage == 3 else 0)}
        if self.cfg.cpu_offload and trainable:
            zero["offload_optimizer"] = {"device": "cpu"}
            if self.cfg.zero_stage == 3:
                zero["offload_param"] = {"device": "cpu"}
        return {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.cfg.grad_clip,
            "zero_optimization": zero,
            "bf16": {"enabled": self.cfg.bf16},  # bf16 module, fp32 master weights in the ZeRO optimizer
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }

    def prepare(self, model: torch.nn.Module, total_steps: int = 1, trainable: bool = True):
        import deepspeed

        model = self._prepared(model, trainable)
        if not trainable:
            engine, *_ = deepspeed.initialize(model=model, config=self._ds_config(False))
            engine.eval()
            engine.module.requires_grad_(False)
            return engine.module, None, None
        optimizer = make_optimizer(model.parameters(), self.optim_cfg)
        scheduler = make_scheduler(optimizer, self.optim_cfg, total_steps)
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self._ds_config(True)
        )
        self.ds_engine, self.model, self.optimizer, self.scheduler = engine, engine.module, optimizer, scheduler
        return self.model, self.optimizer, self.scheduler

    def backward(self, loss: torch.Tensor, last_micro_batch: bool = True) -> None:
        # ZeRO reduces gradients across ranks at the accumulation boundary only: the trainer says
        # which micro-batch closes the optimizer step.
        self._check_loss(loss)
        self.ds_engine.set_gradient_accumulation_boundary(last_micro_batch)
        self.ds_engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        """DeepSpeed's own overflow check skips a step with non-finite gradients (no optimizer or
        scheduler step, gradients cleared); ``was_step_applied`` reports it."""
        self.ds_engine.step()
        skipped = not self.ds_engine.was_step_applied()
        quantity = None
        if self._agree(bool(self._loss_nonfinite)):
            quantity = "loss"
        elif self._agree(skipped):
            quantity = "grad_norm"
        self._loss_nonfinite = False
        self.last_step_skipped, self.nonfinite_quantity = skipped, quantity if skipped else None
        if not skipped:
            self.require_finite_weights("after the optimizer step")
        norm = self.ds_engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    @property
    def train_module(self) -> torch.nn.Module:
        return self.ds_engine

    def unwrap(self, model: torch.nn.Module | None = None) -> torch.nn.Module:
        return self.ds_engine.module if model is None else getattr(model, "module", model)

    def _local_weights(self) -> Iterator[torch.Tensor]:
        """ZeRO-3: the elements of each parameter that this rank's partition really holds (the partitions are padded
        to equal sizes and the padding of the last ones is never written: uninitialised memory, now and then NaN bits,
        once read as a non-finite model on 3 ranks), so only the first ``ds_numel - rank * partition size`` count;
        stages 1-2: the whole parameter."""
        for p in self.unwrap().parameters():
            if not hasattr(p, "ds_tensor"):
                yield p.detach()
                continue
            part = p.ds_tensor.detach().reshape(-1)
            rank = torch.distributed.get_rank(getattr(p, "ds_process_group", None))
            yield part[: max(0, min(part.numel(), p.ds_numel - rank * p.ds_tensor.ds_numel))]

    def _gathered_groups(
        self, model: torch.nn.Module, sent: Callable[[str, torch.nn.Parameter], bool], dtype: torch.dtype | None
    ) -> Iterator[list[tuple[str, torch.nn.Parameter | torch.Tensor]]]:
        """ZeRO-3: each transformer block's partitioned parameters gathered with one all-gather (then one for the rest:
        embeddings, final norm, LM head, the vision tower's patch embedding and merger), where DeepSpeed's own gather,
        even of a list (``GatheredParameters``), makes one per parameter. Each rank's partitions of the unit go out as
        one flat buffer; a parameter whole is its partitions in rank order (ZeRO-3's layout: rank r holds elements
        ``[r * p, (r + 1) * p)`` of the flattened parameter, zero-padded; ``ds_numel`` and ``ds_shape`` its whole size
        and shape), so the same tensors as DeepSpeed's gather (``tests/test_strategy_full_params.py``). Parameters that
        ZeRO-3 keeps whole (small ones), partitions swapped out to NVMe and layouts other than that plain one (ZeRO++'s
        quantized or secondary partitions) go through ``GatheredParameters`` one at a time. Stages 1-2 hold every
        parameter whole."""
        if self.cfg.zero_stage != 3:
            yield from super()._gathered_groups(model, sent, dtype)
            return
        from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus, ZeroParamStatus

        def flat(p: torch.nn.Parameter) -> bool:  # ZeRO-3's plain layout, partitioned now, its partition in memory
            return (
                hasattr(p, "ds_id")
                and p.ds_status == ZeroParamStatus.NOT_AVAILABLE
                and p.ds_tensor.status == PartitionedParamStatus.AVAILABLE  # (not swapped out to NVMe)
                and getattr(p, "ds_secondary_tensor", None) is None
                and not hasattr(p.ds_tensor, "ds_quant_scale")
            )

        blocks = set(transformer_blocks(model))
        units = [""] + [name for name, m in model.named_modules() if m in blocks]
        for members in params_by_unit(model, sent, units).values():
            parts = [p for _, p in members if flat(p)]
            groups = {id(p.ds_process_group) for p in parts}
            if len(groups) != 1:  # nothing partitioned here, or partitions over several groups (not ours)
                yield members
                continue
            group = parts[0].ds_process_group
            world = torch.distributed.get_world_size(group)
            local = torch.cat([p.ds_tensor.reshape(-1).to(self.device) for p in parts])
            every = local.new_empty(world * local.numel())
            torch.distributed.all_gather_into_tensor(every, local, group=group)
            rows, whole, at = every.view(world, -1), {}, 0
            for p in parts:  # each parameter: its partition's columns of every rank's row, in rank order
                size = p.ds_tensor.ds_numel
                whole[id(p)] = rows[:, at : at + size].reshape(-1)[: p.ds_numel].view(p.ds_shape)
                at += size
            yield [(name, whole.get(id(p), p)) for name, p in members]

    def _full_tensor(self, param: torch.nn.Parameter) -> torch.Tensor:
        """ZeRO-3 gathers one partitioned parameter (a copy, released partition intact); stages 1-2 hold it whole."""
        if not hasattr(param, "ds_id"):
            return param.detach()
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.data.detach().clone()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.cfg.zero_stage == 3:
            state = self.ds_engine._zero3_consolidated_16bit_state_dict()
            return {k: v.cpu() for k, v in (state or {}).items()}
        return {k: v.detach().cpu() for k, v in self.ds_engine.module.state_dict().items()}

    @property
    def lr(self) -> float:
        return self.ds_engine.get_lr()[0] if self.ds_engine is not None else 0.0

    def save_checkpoint(self, path: str | Path, client_state: dict[str, Any]) -> None:
        def write(tmp: Path) -> None:
            self.ds_engine.save_checkpoint(str(tmp), tag="ds", save_latest=False)
            (tmp / f"client_rank{self.rank}.pkl").write_bytes(pickle.dumps(client_state))

        self._save_atomically(path, write)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        path = Path(path)
        self.ds_engine.load_checkpoint(str(path), tag="ds", load_optimizer_states=True, load_lr_scheduler_states=True)
        return pickle.loads((path / f"client_rank{self.rank}.pkl").read_bytes())
