"""The configs of a strategy (``strategy``: distribution, precision, memory, LoRA, process settings) and of its
optimizer (``optim``: AdamW and the learning-rate schedule)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlrft.config import option
from vlrft.models.cpu_matmul import wants_onednn
from vlrft.strategies.registry import DEFAULT_STRATEGY, STRATEGIES


@dataclass
class StrategyConfig:
    """How the model is distributed and optimised."""

    name: str = option(DEFAULT_STRATEGY, "training strategy", choices=STRATEGIES)
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
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,in_proj_qkv,in_proj_z,out_proj",
        "comma-separated module names for LoRA (the last three: Qwen3.5's linear-attention projections; a name a model "
        "lacks is skipped)",
    )
    seed: int = option(
        0,
        "seed of new weights: the tiny random model (no model.path), new value and reward heads (train.seed: the rest)",
    )
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

    lr: float = option(1e-6, "peak learning rate", gt=0)
    weight_decay: float = option(0.0, "AdamW weight decay", ge=0)
    betas: list = option([0.9, 0.999], "AdamW betas")
    eps: float = option(1e-8, "AdamW epsilon", ge=0)
    warmup_steps: int = option(0, "linear warm-up steps", ge=0)
    lr_scheduler: str = option("constant", "schedule after warm-up", choices=("constant", "cosine", "linear"))
    min_lr_ratio: float = option(0.0, "final LR as a fraction of lr (cosine, linear)", ge=0, le=1)
