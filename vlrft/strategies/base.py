"""The training-strategy seam: one small interface, three implementations (single, FSDP2, DeepSpeed).

A strategy owns the distributed set-up, wraps model and optimizer, and does backward, optimizer step
(with gradient clipping and the LR schedule), collectives, exact checkpoint save/load and the
full-state export. Trainers call only these methods, so the same loop runs on one CPU process, under
``torchrun`` with gloo, or on a GPU cluster.
"""

from __future__ import annotations

import atexit
import copy
import ctypes
import functools
import gc
import importlib
import inspect
import io
import math
import os
import random
import sys
import threading
import types
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.checkpoint

from vlrft.checkpoints import atomic_dir, commit_dir
from vlrft.config import option
from vlrft.errors import NonFiniteError
from vlrft.models.cpu_matmul import use_onednn_linears, wants_onednn


@dataclass
class StrategyConfig:
    """How the model is distributed and optimised."""

    name: str = option("single", "training strategy", choices=("single", "fsdp2", "deepspeed"))
    zero_stage: int = option(2, "DeepSpeed ZeRO stage (deepspeed only)", choices=(1, 2, 3))
    grad_clip: float = option(1.0, "max global gradient norm (0 disables clipping)")
    mixed_precision: str = option(
        "auto",
        "compute dtype of training forwards: bf16 (bf16 compute and collectives' gathers, fp32 master weights, "
        "AdamW state and gradient reductions: FSDP2's MixedPrecisionPolicy, DeepSpeed's bf16, autocast for single) "
        "or no (the parameters' dtype, model.dtype); auto: bf16 on CUDA, no on CPU (CPU results stay float32)",
        choices=("auto", "bf16", "no"),
    )
    cpu_matmul: str = option(
        "auto",
        "the float32 matrix products of linear layers on a CPU: onednn (oneDNN's kernels, forward and backward) or "
        "mkl (PyTorch's default); auto: onednn where PyTorch runs AVX-512 kernels on a CPU that is not Intel's, whose "
        "MKL keeps to AVX2 there (2.2-2.4x slower on an AMD EPYC), mkl elsewhere. Results differ within float32 "
        "rounding; CUDA, bf16 autocast and compiled blocks are not affected",
        choices=("auto", "onednn", "mkl"),
    )
    cpu_offload: bool = option(False, "offload parameters/optimizer state to CPU memory (fsdp2, deepspeed)")
    gradient_checkpointing: bool = option(False, "recompute activations in backward to save memory")
    compile_blocks: bool = option(
        False,
        "compile each transformer block's forward (decoder layers, vision blocks) with torch.compile (inductor): "
        "fused element-wise kernels, fewer launches per step; attention and decoding with a KV cache stay eager; "
        "the first steps compile (tens of seconds), float rounding differs from eager within a few ulps; with "
        "gradient_checkpointing each compiled block is checkpointed (its backward recomputes it compiled)",
    )
    freeze_vision_tower: bool = option(False, "train only the language model (vision encoder frozen)")
    lora_rank: int = option(0, "LoRA rank through peft (0: full fine-tuning)")
    lora_alpha: int = option(16, "LoRA alpha")
    lora_target_modules: str = option(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "comma-separated module names for LoRA"
    )
    seed: int = option(0, "seed for initialisation, sampling and data order")
    timeout_s: float = option(
        1800.0, "seconds a collective may wait for a lost or stuck rank before the job stops (process group)"
    )
    heartbeat_timeout_s: float = option(
        60.0, "a rank silent this long (stuck) or gone (killed) stops every other rank, naming it (0: off)"
    )
    keep_freed_memory: str = option(
        "auto",
        "host memory the process frees stays with it for the next tensor (glibc malloc: no mmap per large tensor, "
        "no trimming), so a training step does not page-fault its activations in anew; the process keeps its peak "
        "memory. auto: on when training on CPU",
        choices=("auto", "yes", "no"),
    )

    @property
    def bf16(self) -> bool:
        """Whether training forwards compute in bf16 (``mixed_precision``, ``auto`` resolved for this machine)."""
        return self.mixed_precision == "bf16" or (self.mixed_precision == "auto" and torch.cuda.is_available())

    @property
    def onednn(self) -> bool:
        """Whether CPU float32 linear layers compute through oneDNN (``cpu_matmul``, ``auto`` resolved for this
        machine)."""
        return wants_onednn(self.cpu_matmul)

    def validate(self) -> None:
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0, got {self.grad_clip}")
        wants_onednn(self.cpu_matmul)  # onednn where this PyTorch has no oneDNN kernel: an error
        if self.timeout_s <= 0 or self.heartbeat_timeout_s < 0:
            raise ValueError(
                f"strategy.timeout_s must be > 0 and strategy.heartbeat_timeout_s >= 0, got "
                f"{self.timeout_s} and {self.heartbeat_timeout_s}"
            )


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule (AdamW, linear warm-up, then constant or cosine)."""

    lr: float = option(1e-6, "peak learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay")
    betas: list = option([0.9, 0.999], "AdamW betas")
    eps: float = option(1e-8, "AdamW epsilon")
    warmup_steps: int = option(0, "linear warm-up steps")
    lr_scheduler: str = option("constant", "schedule after warm-up", choices=("constant", "cosine", "linear"))
    min_lr_ratio: float = option(0.0, "final LR as a fraction of lr (cosine, linear)")


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment; returns (rank, world_size). A collective
    waiting longer than ``timeout_s`` for another rank fails instead of hanging."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    atexit.register(_destroy_process_group)
    return dist.get_rank(), dist.get_world_size()


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4


def mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt(param, value)``; False where the C library has none (macOS) or refuses the value."""
    call = getattr(ctypes.CDLL(None), "mallopt", None)
    return call is not None and bool(call(param, value))


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the memory this process frees for its next allocations: no ``mmap`` per large
    allocation (``M_MMAP_MAX`` 0) and no return of the heap's free top to the system (``M_TRIM_THRESHOLD`` at its
    largest). By default glibc maps every allocation above a threshold (128 KiB, raised as such blocks are freed, at
    most 32 MiB) afresh and unmaps it when freed, and trims the heap, so each training step touches its activations'
    pages anew: a page fault per 4 KiB page, which costs more than the element-wise work that writes it on a virtual
    machine (docs/benchmarks.md: 2-100 k faults per update step of the 21 M benchmark, 0 with this). The process
    keeps its peak memory, as PyTorch's CUDA caching allocator does on a GPU; jemalloc or tcmalloc through
    ``LD_PRELOAD`` (PyTorch's CPU tuning guide) do the same job. Returns whether it applied (False where the C
    library has no ``mallopt``: macOS, or musl's, which ignores it)."""
    return mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, 2**31 - 1)


def _destroy_process_group() -> None:
    """At exit, the process group leaves the registry before the interpreter tears down. That alone does not end
    its worker threads while FSDP2's device meshes still hold the group; ``finish_process`` is what makes the end
    of a distributed process safe."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def finish_process(code: int) -> int:
    """End the main function of a process that may have joined a process group: ``return finish_process(code)``.

    Alone, or as the only rank of its group, it returns ``code``. As one rank of several it ends the process here:
    every non-daemon thread joined, Python's exit handlers (the process group's destruction, loggers, trackers),
    every open file's buffer flushed, then ``os._exit(code)``, which skips the interpreter's finalisation, as
    ``multiprocessing`` ends its children. The reason is a race in that finalisation: a gloo worker thread may still
    be releasing a finished collective (its tensors' Python objects) when the main thread starts finalising; that
    thread then needs the GIL, which a finalising interpreter refuses by ending the thread, and the forced unwind
    through a C++ destructor calls ``std::terminate``: SIGABRT, "terminate called without an active exception",
    after all the work is done. Seen about once in 50 two-rank FSDP2 updates under load on 2 cores, with this core
    dump's stack: thread ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherCoalescedWork`` -> ``decref_pyobject`` ->
    ``PyThread_exit_thread`` -> ``std::terminate``, the main thread in ``Py_FinalizeEx``."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return code
    # what the interpreter's exit does before finalising, in its order: threading's exit hooks (a thread pool's
    # idle workers are told to stop) and the join of the non-daemon threads, then the atexit handlers
    getattr(threading, "_shutdown", lambda: None)()
    atexit._run_exitfuncs()
    # what finalisation would have written: every open file object's buffer (a user's reward function may keep a
    # log open), standard output and error last
    # by type, not isinstance: a weak proxy whose object is gone (torch.compile leaves some) raises on isinstance
    files = [
        f for f in gc.get_objects() if issubclass(type(f), io.IOBase) and f is not sys.stdout and f is not sys.stderr
    ]
    for stream in [*files, sys.stdout, sys.stderr]:
        try:
            if not stream.closed and stream.writable():
                stream.flush()
        except Exception:  # closed meanwhile, a broken pipe, a file object of its own kind: the work is done anyway
            pass
    os._exit(code)


def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from (python, numpy, torch CPU and CUDA)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Linear warm-up to ``lr``, then constant, cosine or linear decay to ``min_lr_ratio * lr``."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_scheduler == "constant" or total_steps <= cfg.warmup_steps:
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_scheduler == "cosine" else 1 - progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable ``params``, torch's per-tensor loop. Its fused kernel (``fused=True``) is 3x faster
    on CPU (13 ms against 38 ms for 21 M parameters, docs/benchmarks.md) but rounds differently by a few ulps, which
    moves two learning proofs of the slow suite off the trajectories they were shown on (the tools proof's SFT stage
    reached 0.75, the judge RL proof stayed at the positive verdict); it waits until those proofs hold across float
    rounding."""
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )


# the transformer blocks of a Qwen(-VL) model, by class name: what FSDP2 shards one by one, what
# ``strategy.compile_blocks`` compiles and ``strategy.gradient_checkpointing`` checkpoints
BLOCK_CLASS_SUFFIXES = ("DecoderLayer", "VisionBlock")


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of ``model`` (decoder layers and vision blocks), in module order."""
    return [m for m in model.modules() if type(m).__name__.endswith(BLOCK_CLASS_SUFFIXES)]


def own_block_forwards(model: torch.nn.Module, compile: bool, checkpoint: bool) -> int:
    """Each transformer block's forward replaced, in place, by :func:`_block_forward`: the block's own forward
    (transformers' checkpointing wrapper removed: :func:`_own_forward`), compiled with torch.compile (inductor)
    where ``compile`` (``strategy.compile_blocks``), and checkpointed inside the forward where ``checkpoint``
    (``strategy.gradient_checkpointing``, enabled through transformers first, whose own checkpointing of the block
    is then off). The module, its parameters' names and the hooks FSDP2 or DeepSpeed put on it stay as they are and
    run around it. Returns the number of blocks.

    Checkpointing inside the forward, whatever the transformers release: transformers < 5.2x checkpoints a block
    around its ``__call__``, so the backward's recompute runs FSDP2's pre-forward hook again, which on torch < 2.13
    returns the inputs uncast in that state. The recompute then saw the vision tower's float32 rotary tables where
    the forward had FSDP2's bf16 casts: silently other activations in eager blocks, a CheckpointError in compiled
    ones (the third H200 run: torch 2.11, transformers 5.17). Transformers >= 5.2x checkpoints inside the forward,
    as here.

    Compiled blocks: a decoder layer called with a KV cache (decoding) runs its eager forward (a cache is a Python
    object that changes at every token); the attention functions vlrft registers run their packed-layout parts
    eagerly (``torch.compiler.disable``: Python data, different at every step). One compiled function per block
    class, with dynamic shapes, which takes the block as an argument (dynamo reads its parameters as inputs), so all
    blocks of a class share its graphs and a copied model calls its own blocks; the checkpoint goes around the
    compiled forward (inside a compiled function dynamo would trace it as one graph, which the eager attention
    breaks, and then run the whole block eagerly: measured, no graph compiled at all), and the recompute runs it
    compiled."""
    blocks = transformer_blocks(model)
    for block in blocks:
        block.vlrft_compiled = compile
        block.vlrft_checkpoint = None
        if checkpoint:  # what transformers' enabling set (use_reentrant=False here), else the same
            fallback = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
            block.vlrft_checkpoint = getattr(block, "_gradient_checkpointing_func", fallback)
            block.gradient_checkpointing = False  # transformers' own, around __call__ (< 5.2x) or in forward
        block.forward = types.MethodType(_block_forward, block)
    return len(blocks)


# per block class: its own forward (transformers' checkpointing wrapper removed) and, once asked for, compiled
_OWN_FORWARDS: dict[type, list[Any]] = {}


def _block_forward(block: torch.nn.Module, *args, **kwargs):
    """A block's forward as :func:`own_block_forwards` sets it (compiled, checkpointed, or both)."""
    own = _OWN_FORWARDS.get(type(block))  # FSDP2's subclass of the block's class (``fully_shard``) has its own
    if own is None:
        own = _OWN_FORWARDS[type(block)] = [_own_forward(type(block).forward), None]
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return own[0](block, *args, **kwargs)  # decoding: eager, not checkpointed (a replay would write the cache)
    if block.vlrft_compiled:
        if own[1] is None:
            own[1] = torch.compile(own[0], dynamic=True)
        call = own[1]
    else:
        call = own[0]
    if block.vlrft_checkpoint is not None and block.training and torch.is_grad_enabled():
        return block.vlrft_checkpoint(functools.partial(call, block, **kwargs), *args)
    return call(block, *args, **kwargs)


def _own_forward(forward: Any) -> Any:
    """A block class's forward without transformers' activation checkpointing wrapper (``forward_with_checkpointing``,
    which transformers >= 5.2x puts around every layer class's forward, once per subclass such as FSDP2's; earlier
    releases checkpoint in ``__call__`` instead, which ``block.gradient_checkpointing = False`` turns off). Other
    wrappers (decorators) stay."""
    return inspect.unwrap(
        forward, stop=lambda f: getattr(f, "__code__", None) is None or f.__code__.co_name != _HF_CKPT
    )


_HF_CKPT = "forward_with_checkpointing"  # transformers.modeling_layers.GradientCheckpointingLayer's wrapper


def any_nonfinite(tensors: list[torch.Tensor]) -> bool:
    """Whether an element of ``tensors`` is NaN or infinite, with one device sync for all of them. Each tensor's
    absolute sum (``torch._foreach_norm(tensors, 1)``: on a GPU a few multi-tensor kernels for all the tensors, where
    each tensor's extremes and their stack were two launches per tensor, 1,655 of the 21.5 k operators of a 3B update
    step: docs/benchmarks.md) is NaN or infinite when one of its elements is, since NaN and infinities
    propagate through sums. The absolute sum of a tensor whose elements are all finite can still overflow its dtype
    (above 3.4e38 in float32, far beyond any trained weights), so a tensor so flagged is read again by its extremes,
    which are finite exactly when all its elements are: only NaN and infinite elements count."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return False
    flagged = (~torch.stack(torch._foreach_norm(tensors, 1)).isfinite()).nonzero().flatten().tolist()
    return any(not bool(torch.stack(torch.aminmax(tensors[i])).isfinite().all()) for i in flagged)


def mean_over_ranks(strategy: Any, metrics: dict[str, float], weight: float = 1.0, missing: str = "skip") -> dict:
    """Metrics averaged over the ranks, each rank's weighted by ``weight`` (its count of prompts, say), over the union
    of the ranks' keys (one collective shape everywhere). A key a rank lacks is left out of that key's mean
    (``missing="skip"``: a figure undefined on its share) or counts as 0 (``"zero"``: a count of nothing)."""
    if not strategy.distributed:
        return dict(metrics)
    keys = sorted(set().union(*strategy.all_gather_object(sorted(metrics))))
    rows = [[metrics.get(k, 0.0) * weight, weight if k in metrics or missing == "zero" else 0.0] for k in keys]
    total = strategy.all_reduce(torch.tensor(rows, dtype=torch.float64), "sum").tolist()
    return {k: s / n for k, (s, n) in zip(keys, total) if n > 0}


class Strategy:
    """Base class: distributed set-up, collectives, model preparation shared by all strategies."""

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
        """What every strategy does to a model before placing and wrapping it: :meth:`_adapt_model` where it trains;
        oneDNN linear layers where it computes on the CPU and ``strategy.cpu_matmul`` says so (frozen models too)."""
        model = self._adapt_model(model) if trainable else model
        if self.device.type == "cpu" and self.cfg.onednn:
            use_onednn_linears(model)
        return model

    def _adapt_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Training mode, freezing, LoRA and gradient checkpointing, before any wrapping.

        ``from_pretrained`` returns a model in eval mode, and transformers recomputes activations only
        in training mode: without ``train()`` gradient checkpointing was silently off (seen on a GPU
        as the memory of a run with it on)."""
        model.train()
        if self.cfg.lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model,
                LoraConfig(
                    r=self.cfg.lora_rank,
                    lora_alpha=self.cfg.lora_alpha,
                    target_modules=[m.strip() for m in self.cfg.lora_target_modules.split(",") if m.strip()],
                    lora_dropout=0.0,
                ),
            )
        if self.cfg.freeze_vision_tower:  # after LoRA: peft also puts trainable adapters on the tower's MLPs
            for name, p in model.named_parameters():
                if ".visual." in f".{name}" or name.startswith("visual") or "vision_tower" in name:
                    p.requires_grad_(False)
        if self.cfg.gradient_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()
            if hasattr(model, "config"):
                model.config.use_cache = False
        if self.cfg.compile_blocks or self.cfg.gradient_checkpointing:
            own_block_forwards(model, self.cfg.compile_blocks, self.cfg.gradient_checkpointing)
        return model

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
        elif self._agree(self.optim_cfg.eps == 0 and _adamw_zero_over_zero(self.optimizer)):
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
        """This rank's share of the trained parameters (ZeRO-3: its partition; FSDP2: its shard)."""
        for p in self.unwrap().parameters():
            yield _local(getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else p.detach())

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
        model = self.unwrap()
        lora_layers = {
            name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")
        }

        def owner(name: str) -> str:
            return name.rpartition(".")[0].removesuffix(".base_layer")

        def sent(name: str, param: torch.nn.Parameter) -> bool:
            if ".lora_" in name:
                return False
            return not (trainable_only and not param.requires_grad and owner(name) not in lora_layers)

        # a merged LoRA weight is summed in float32, then rounded once by the caller (a casting gather rounds first)
        for group in self._gathered_groups(model, sent, None if lora_layers else dtype):
            for name, param in group:
                tensor, layer = self._full_tensor(param), lora_layers.get(owner(name))
                if layer is not None and name.endswith(".base_layer.weight"):
                    tensor = tensor + self._lora_delta(layer).to(tensor.dtype)
                yield _hf_name(name), tensor

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

    def _lora_delta(self, layer: torch.nn.Module) -> torch.Tensor:
        """peft's merge of a Linear LoRA layer: the sum over active adapters of ``scaling * B @ A``."""
        delta = None
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            a = self._full_tensor(layer.lora_A[adapter].weight).float()
            b = self._full_tensor(layer.lora_B[adapter].weight).float()
            term = (b @ a) * layer.scaling[adapter]
            delta = term if delta is None else delta + term
        return delta if delta is not None else torch.zeros(())

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
            model = self.unwrap()
            if hasattr(model, "merge_and_unload") and self.cfg.lora_rank > 0:
                merged = copy.deepcopy(model)
                merged.load_state_dict(state)
                model, state = merged.merge_and_unload(), None
            with _unwrap_without_deepspeed(self.cfg.name != "deepspeed"):
                model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
            if processor is not None:
                processor.save_pretrained(out_dir)
        self.barrier()

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else 0.0


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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _adamw_zero_over_zero(optimizer: torch.optim.Optimizer) -> bool:
    """Whether AdamW with ``eps=0`` would write NaN: an element whose gradient and second moment are both
    zero gets ``0 / (sqrt(0) + 0)``."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            zero_grad = _local(p.grad) == 0
            v = optimizer.state.get(p, {}).get("exp_avg_sq")
            if bool((zero_grad & (_local(v) == 0) if v is not None else zero_grad).any()):
                return True
    return False


def params_by_unit(
    model: torch.nn.Module, sent: Callable[[str, torch.nn.Parameter], bool], units: Iterable[str]
) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """``model``'s parameters that ``sent`` keeps, ``(name, parameter)`` in module order, by the innermost of ``units``
    (module names, which must include ``""``, the model) that holds each: what a sharded strategy gathers together."""
    units = set(units)
    groups: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        if sent(name, param):
            unit = name
            while unit not in units:
                unit = unit.rpartition(".")[0]
            groups.setdefault(unit, []).append((name, param))
    return groups


def _hf_name(name: str) -> str:
    """A parameter name as the model's own ``state_dict`` (and vLLM) knows it: without peft's wrapping."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")
