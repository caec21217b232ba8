"""FSDP2: ``torch.distributed.fsdp.fully_shard`` per vision block, per decoder layer, then the root.

Checkpoints use ``torch.distributed.checkpoint`` (each rank writes its shards; the optimizer state is
saved in the same sharded form), so resume is exact. The full state for export is gathered with
``StateDictOptions(full_state_dict=True, cpu_offload=True)``.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from vlrft.strategies.base import Strategy
from vlrft.strategies.blocks import transformer_blocks
from vlrft.strategies.registry import register_strategy
from vlrft.strategies.weight_stream import params_by_unit

# torch >= 2.13 warns, on every run, when an FSDP2-wrapped module returns a view: an in-place op on that view
# would drop the pre-backward hook (no all-gather for the backward). A Qwen-VL's output (transformers 5.2x) carries
# its image features split per image, views, beside the logits. vlrft reads model outputs out of place only
# (indexing, log_softmax, gathers; those image features not at all) and the FSDP2 tests compare gradients with
# single-process training, so the warning says nothing to our users and is not shown (tests/test_single_gpu_paths.py).
_VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"


@register_strategy("fsdp2")
class FSDP2Strategy(Strategy):
    @property
    def shards_parameters(self) -> bool:
        return self.distributed

    @property
    def _gather_dtype(self) -> torch.dtype | None:
        """What FSDP2's gathers cast the parameters to (its mixed-precision policy's ``param_dtype``): bf16 with
        ``strategy.mixed_precision`` bf16, else None (the parameters' float32)."""
        return torch.bfloat16 if self.cfg.bf16 else None

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        warnings.filterwarnings("ignore", message=_VIEW_WARNING, category=UserWarning)
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device_type, (self.world_size,))
        kwargs: dict[str, Any] = {"mesh": mesh}
        # each block's gathered parameters cast to the gather dtype; its fp32 shards are the master weights
        if self._gather_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=self._gather_dtype, reduce_dtype=torch.float32)
        if self.cfg.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for block in transformer_blocks(model):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def prepare(self, model: torch.nn.Module, total_steps: int = 1, trainable: bool = True):
        model = self._prepared(model, trainable)
        if not self.cfg.cpu_offload:
            model = model.to(self.device)
        return self._with_optimizer(self._shard(model), total_steps, trainable)

    def backward(self, loss: torch.Tensor, last_micro_batch: bool = True) -> None:
        self._check_loss(loss)
        loss.backward()

    def step(self) -> float:
        return self._clip_and_step()

    def _full_tensor(self, param: torch.nn.Parameter) -> torch.Tensor:
        """All-gather one sharded parameter (a DTensor); with CPU offload on GPUs it is gathered on the GPU."""
        tensor = param.detach()
        if not isinstance(tensor, DTensor):
            return tensor
        if tensor.device.type == "cpu" and self.device.type == "cuda":
            tensor = tensor.to(self.device)
        return tensor.full_tensor()

    def _gathered_groups(
        self, model: torch.nn.Module, sent: Callable[[str, torch.nn.Parameter], bool], dtype: torch.dtype | None
    ) -> Iterator[list[tuple[str, torch.nn.Parameter]]]:
        """Each FSDP2 unit's own parameters (a block's; the root's: embeddings, final norm, LM head, the vision tower's
        patch embedding and merger) gathered together by FSDP2's ``unshard`` (one all-gather into one buffer per unit,
        where a ``full_tensor`` per parameter made one collective each: 69 against 825 at Qwen2.5-VL-3B's depth),
        resharded once the caller has read them. The unit's gather casts to the mixed-precision policy's dtype (bf16),
        so with one it is used only for a caller that casts to that dtype itself; otherwise parameter by parameter,
        in the parameters' dtype. Units with nothing to send (a frozen vision block) are not gathered."""
        units = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
        if "" not in units or self._gather_dtype not in (None, dtype):
            yield from super()._gathered_groups(model, sent, dtype)
            return
        for unit, members in params_by_unit(model, sent, units).items():
            units[unit].unshard()
            try:  # the unit's parameters are now its gathered ones, under the same names
                yield [(name, model.get_parameter(name)) for name, _ in members]
            finally:
                units[unit].reshard()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, _ = get_state_dict(self.model, [], options=opts)
        return model_state

    def save_checkpoint(self, path: str | Path, client_state: dict[str, Any]) -> None:
        def write(tmp: Path) -> None:
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp / "dcp"))
            # client state (RNG, data position) differs per rank: one file each
            extra = {"client_state": client_state, "scheduler": self.scheduler.state_dict()}
            (tmp / f"client_rank{self.rank}.pkl").write_bytes(pickle.dumps(extra))

        self._save_atomically(path, write)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        path = Path(path)
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        # strict=False: parameters that never received a gradient (e.g. the vision tower after text-only
        # batches) legitimately have no optimizer state in either the checkpoint or the fresh optimizer.
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(strict=False),
        )
        extra = pickle.loads((path / f"client_rank{self.rank}.pkl").read_bytes())
        self.scheduler.load_state_dict(extra["scheduler"])
        if dist.is_initialized():
            dist.barrier()
        return extra["client_state"]
