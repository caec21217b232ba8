"""The linear layers' float32 matrix products on x86 CPUs through oneDNN instead of MKL (``strategy.cpu_matmul``).

PyTorch's float32 ``F.linear`` and ``matmul`` on a CPU call MKL's sgemm. MKL takes its AVX-512 kernels on Intel's
CPUs only: on an AMD EPYC with AVX-512 (the machines CI and the benches run on) its sgemm runs its AVX2 branch, 105
GFLOP/s on one thread, where oneDNN's float32 products, which PyTorch ships too, run 230-256 GFLOP/s on the same
core (``scripts/bench_grpo_step.py`` measures both; docs/benchmarks.md). :func:`use_onednn_linears` routes every
``nn.Linear`` of a model through :func:`onednn_linear`: the forward ``x W^T + b`` and, in the backward, ``g W`` and
``g^T x`` as oneDNN products (``torch.ops.mkldnn._linear_pointwise``, the kernel of PyTorch's own oneDNN linear);
the bias gradient is a sum. Same products, same float32 inputs and outputs; the sums are ordered differently, so
results differ from MKL's within float32 rounding (``tests/test_cpu_matmul.py`` bounds both against float64).

This module is the whole oneDNN path, behind one switch: the strategy reads ``strategy.cpu_matmul``
(``strategies.config``, :func:`wants_onednn`) and applies :func:`use_onednn_linears` to the models it prepares
(``strategies.adapt.adapt_for_device``). The model code it reaches does not name oneDNN: it calls the product hooks
this module sets on the modules (``prompt_matmul`` on the attention, ``patch_linear`` on the patch embedding), and an
inference copy computes as its policy through the hook its layers carry (``OneDNNLinear.prepare_copy``).

Only float32 CPU tensors outside autocast and outside ``torch.compile`` take it; anything else (CUDA, bf16 autocast,
a compiled block, a DTensor) goes through ``F.linear`` as before.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def onednn_available() -> bool:
    """Whether this PyTorch has oneDNN's float32 linear kernel."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def onednn_faster() -> bool:
    """``strategy.cpu_matmul=auto``'s rule: oneDNN where PyTorch runs its AVX-512 kernels on a CPU that is not
    Intel's (MKL's sgemm keeps to AVX2 there: 105 against oneDNN's 230-256 GFLOP/s on one core of the AMD EPYC the
    benches ran on). On Intel's CPUs MKL has AVX-512 kernels of its own, and on AVX2 machines (the tests pin AVX2:
    tests/conftest.py) the two libraries have the same vector width, so MKL, PyTorch's default, is kept: neither was
    measured faster with oneDNN. ``ATEN_CPU_CAPABILITY=avx2`` caps it like the tests do."""
    if not onednn_available() or torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX512_BF16", "AMX"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return False
    return bool(vendor) and vendor != "GenuineIntel"


def wants_onednn(setting: str) -> bool:
    """``strategy.cpu_matmul`` (or ``vlrft eval --cpu-matmul``) resolved for this machine: ``onednn``, ``mkl``, or
    ``auto`` (:func:`onednn_faster`)."""
    if setting == "onednn" and not onednn_available():
        raise ValueError(f"cpu_matmul={setting}: this PyTorch has no oneDNN float32 linear kernel (mkldnn)")
    return setting == "onednn" or (setting == "auto" and onednn_faster())


def _product(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight_t^T + bias`` by oneDNN (``weight_t``: 2-D, rows are output features). Either operand may be a
    transposed view: the kernel reads it as it is laid out (no copy made here; timed no slower than contiguous
    operands, 20.8 against 24.1 ms for the weight gradient of a 1,900-token 512 -> 2048 layer)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight_t, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        rows = grad.reshape(-1, grad.shape[-1])  # (tokens, out)
        if ctx.needs_input_grad[0]:
            grad_x = _product(grad, weight.t())  # g W
        if ctx.needs_input_grad[1]:
            grad_w = _product(rows.t(), x.reshape(-1, x.shape[-1]).t())  # g^T x: (out, tokens) by (tokens, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0)
        return grad_x, grad_w, grad_b


def _takes_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and type(weight) in (torch.Tensor, nn.Parameter)  # not a DTensor (FSDP2 gathers before the forward)
        and weight.device.type == "cpu"
        and x.numel() > 0
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    )


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its products (forward and backward) by oneDNN where :func:`_takes_onednn`
    allows, else ``F.linear`` itself."""
    if not _takes_onednn(x, weight):
        return F.linear(x, weight, bias)
    needs_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and needs_grad:
        return _OneDNNLinear.apply(x, weight, bias)
    return _product(x, weight, bias)


# a product of fewer multiply-adds than this goes to ``torch.matmul`` in :func:`onednn_matmul`: oneDNN's 11-14 us per
# call outweighs its faster kernel below about a million (8 x 64 by 64 x 64: 14.3 against MKL's 3.0 us; a decode
# step's prompt attention, 32 x 128 by 128 x 182 per prompt and KV head, 0.75 M: 342 against 265 us a layer); 4 M
# leaves a margin, and the training forward's prompt products (1,536 x 128 by 128 x 183, 36 M) are far above it
MATMUL_MIN_MACS = 1 << 22


def _batched_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``a`` ``[N, m, k]`` and ``b`` ``[N, k, n]`` (either may be a transposed view): one oneDNN
    product per batch element."""
    return torch.stack([_product(a[i], b[i].t()) for i in range(a.shape[0])])


class _OneDNNMatmul(torch.autograd.Function):
    """:func:`_batched_product` forward and backward (``g b^T`` and ``a^T g``)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return _batched_product(a, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        grad_a = _batched_product(grad, b.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        grad_b = _batched_product(a.transpose(1, 2), grad) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def onednn_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (``a`` ``[..., m, k]``, ``b`` ``[..., k, n]``, the same batch shape) with its products, forward and
    backward, by oneDNN: one call per batch element, for batches of large products (the attention of a group's
    responses over their shared prompt: ``prefix_decoding.prefix_attention``; MKL's batched sgemm runs them at 87
    GFLOP/s on the AMD EPYC of docs/benchmarks.md). ``torch.matmul`` itself where :func:`_takes_onednn` does not
    allow it, for other shapes, and for products of fewer than :data:`MATMUL_MIN_MACS` multiply-adds."""
    if (
        a.dim() < 3
        or a.shape[:-2] != b.shape[:-2]
        or a.shape[-1] != b.shape[-2]
        or a.shape[-2] * a.shape[-1] * b.shape[-1] < MATMUL_MIN_MACS
        or not _takes_onednn(a, b)
    ):
        return torch.matmul(a, b)
    batch, (m, k), n = a.shape[:-2], a.shape[-2:], b.shape[-1]
    a3, b3 = a.reshape(-1, m, k), b.reshape(-1, k, n)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        out = _OneDNNMatmul.apply(a3, b3)
    else:
        out = _batched_product(a3, b3)
    return out.view(*batch, m, n)


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`onednn_linear` (a layer's class is swapped in place: same parameters,
    same state dict, still an ``nn.Linear`` to peft and FSDP2)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return onednn_linear(input, self.weight, self.bias)

    @staticmethod
    def prepare_copy(model: nn.Module) -> None:
        """Make ``model``, a copy of the model this layer is in, compute as that model does (the hook a module of a
        policy carries for its inference copy: ``rollout.inference_copy.load_inference_copy``)."""
        use_onednn_linears(model)


def uses_onednn(model: nn.Module) -> bool:
    """Whether ``model``'s linear layers compute by oneDNN (:func:`use_onednn_linears` swapped them)."""
    return any(isinstance(m, OneDNNLinear) for m in model.modules())


def use_onednn_linears(model: nn.Module) -> int:
    """Route each plain ``nn.Linear`` of ``model`` through oneDNN (:class:`OneDNNLinear`); returns how many. Layers of
    other classes (peft's LoRA wrappers, whose inner ``nn.Linear`` layers are swapped) are left alone. A vision
    tower's patch embedding, a ``Conv3d`` computed as the linear product it is (``patch_embedding.patch_product``),
    and the attention modules (those with ``is_causal``), whose responses attend to their shared prompt
    (``prefix_decoding.prefix_attention``), compute those products by oneDNN too: the convolution's ``patch_linear``
    is :func:`onednn_linear`, the attention's ``prompt_matmul`` :func:`onednn_matmul` (the hooks the model code calls,
    ``F.linear`` and ``torch.matmul`` where unset), and ``onednn_product`` marks both."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            count += 1
        elif isinstance(module, nn.Conv3d):
            module.onednn_product, module.patch_linear = True, onednn_linear
        elif hasattr(module, "is_causal"):
            module.onednn_product, module.prompt_matmul = True, onednn_matmul
    return count
