"""A Qwen-VL vision tower's patch embedding (a ``Conv3d`` whose kernel is its stride) computed as the linear
product it is (``use_linear_patch_embedding``, called by ``loading.load_model``)."""

from __future__ import annotations

import types

import torch


def use_linear_patch_embedding(model: torch.nn.Module) -> int:
    """A Qwen-VL vision tower's patch embedding computed as the matrix product it is. Its ``Conv3d`` has its kernel as
    its stride, no padding, no dilation, no groups, and is given whole patches (``[patches, channels, temporal, patch,
    patch]``): each goes in whole and one vector comes out, so the convolution is ``F.linear`` of the flattened
    patches with the kernel flattened to ``[embed, channels * temporal * patch * patch]``: the same products, summed
    in the GEMM's order instead of the convolution's (Higham's dot-product bound holds for both;
    tests/test_patch_embedding.py).

    Why: cuDNN's algorithms for this shape are pathological in some versions and dtypes (transformers issue 45750:
    50,000x the linear's time on Blackwell in bf16; SGLang-Omni measured 3.7 s a call on an H100 in bf16; NVIDIA TAO
    replaced it where cuDNN 9.20 lacks the bf16 engine its backward needs); vLLM and SGLang compute it as a linear. On
    a CPU the product is 4-5x faster than the convolution, forward and backward (106 -> 23 ms at the CPU bench's
    images, 3.36 -> 0.76 s at the 3B shape's; docs/benchmarks.md).

    The convolution module stays, with its parameter (``proj.weight``, 5-D, under its name) and its hooks, which
    DeepSpeed ZeRO-3 gathers the weight in: only its forward changes, so checkpoints, the weight stream to vLLM and the
    strategies see the model unchanged (transformers' own ``fusion_config={"patch_embeddings": True}`` renames it).
    Returns the number switched."""
    switched = 0
    for module in model.modules():
        proj = getattr(module, "proj", None)
        if (
            type(module).__name__.endswith("PatchEmbed")
            and isinstance(proj, torch.nn.Conv3d)
            and tuple(proj.stride) == tuple(proj.kernel_size)
            and tuple(proj.padding) == (0, 0, 0)
            and tuple(proj.dilation) == (1, 1, 1)
            and proj.groups == 1
        ):
            proj.forward = types.MethodType(_patch_embedding_forward, proj)
            switched += 1
    return switched


def patch_product(conv: torch.nn.Conv3d, patches: torch.Tensor) -> torch.Tensor:
    """A patch embedding's convolution with its kernel as its stride, on whole patches ``[N, C, T, P, P]``, as the
    matrix product it equals: ``[N, embed, 1, 1, 1]``, as the convolution returns; by the convolution's
    ``patch_linear`` where the strategy set one (the kernel the model's linear layers compute by), else ``F.linear``."""
    linear = getattr(conv, "patch_linear", torch.nn.functional.linear)
    out = linear(patches.flatten(1), conv.weight.flatten(1), conv.bias)
    return out[:, :, None, None, None]


def _patch_embedding_forward(conv: torch.nn.Conv3d, patches: torch.Tensor) -> torch.Tensor:
    """The switched convolution's forward (:func:`use_linear_patch_embedding`): the product for whole patches, the
    convolution itself for anything else."""
    if tuple(patches.shape[2:]) == tuple(conv.kernel_size):
        return patch_product(conv, patches)
    return type(conv).forward(conv, patches)
