"""Qwen-VL vision towers embed their patches with a matrix product (``use_linear_patch_embedding``, applied by
``load_model``), on a CPU and on CUDA: the output and the gradients of the convolution it replaces, each within the
rounding that any order of the same float32 sums allows, against float64."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_within

from vlrft.models.loading import load_model
from vlrft.models.patch_embedding import _patch_embedding_forward, patch_product, use_linear_patch_embedding

U = 2.0**-24  # float32's unit roundoff


def dot_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Higham (Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5): a float32 dot product of K terms,
    summed in any order, is within gamma_K * sum |a_i b_i| of the exact one, gamma_K = K u / (1 - K u); so each entry
    of ``a @ b`` (K = a's last dimension), whatever kernel computes it."""
    k = a.shape[-1]
    return k * U / (1 - k * U) * (a.abs().double() @ b.abs().double())


def patch_embeddings(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("PatchEmbed")]


def within_the_dot_product_bound(embed: torch.nn.Module, forward, what: str) -> None:
    """``forward(x)`` (flattened patches, as the processor gives them) against the convolution in float64: the
    output, the input's and the weight's gradients, each within the worst-case float32 bound of its dot products."""
    weight = embed.proj.weight  # [embed, C, T, P, P]: the convolution's parameter, unchanged
    assert weight.dim() == 5 and "proj.weight" in dict(embed.named_parameters())
    k = weight[0].numel()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(97, k, generator=g).to(weight.device).requires_grad_()  # 97 patches
    grad_out = torch.randn(97, weight.shape[0], generator=g).to(weight.device)
    out = forward(x)
    (dx, dw) = torch.autograd.grad(out, (x, weight), grad_out)
    # float64 reference: the convolution itself on float64 copies, on the CPU
    x64, w64 = x.detach().cpu().double().requires_grad_(), weight.detach().cpu().double().requires_grad_()
    b64 = None if embed.proj.bias is None else embed.proj.bias.detach().cpu().double()
    patches = x64.view(-1, *weight.shape[1:])
    ref = torch.nn.functional.conv3d(patches, w64, b64, stride=embed.proj.stride).view(97, -1)
    ref_dx, ref_dw = torch.autograd.grad(ref, (x64, w64), grad_out.cpu().double())
    x32, w2, g32 = x.detach().cpu(), weight.detach().cpu().flatten(1), grad_out.cpu()  # w2: [embed, K]
    checks = [
        ("output", out, ref, dot_bound(x32, w2.t())),  # K = C*T*P*P terms
        ("input gradient", dx, ref_dx, dot_bound(g32, w2)),  # embed terms
        ("weight gradient", dw.flatten(1), ref_dw.flatten(1), dot_bound(g32.t(), x32)),  # 97 terms
    ]
    for name, got, exact, bound in checks:
        assert exact.abs().max() > 1e-3  # a real value
        # float64's own rounding (2^-53 relative per operation) is far below float32's: a 1e-12 slack covers it
        share = ((got.cpu().double() - exact).abs() / (bound + 1e-12)).max().item()
        assert_within(share, 1.0, f"{what}: {name} error / its worst-case float32 bound")


def embed_with(embed: torch.nn.Module, product):
    """``embed``'s forward on flattened patches with ``product(conv, patches)`` as its convolution."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        patches = x.view(-1, *embed.proj.weight.shape[1:])
        return product(embed.proj, patches).view(x.shape[0], -1)

    return forward


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_patch_product_gives_the_convolutions_output_and_gradients(tiny_model, arch):
    model, _ = load_model(tiny_model(arch))
    (embed,) = patch_embeddings(model)
    assert embed.proj.forward.__func__ is _patch_embedding_forward  # load_model switched it
    within_the_dot_product_bound(embed, embed_with(embed, patch_product), f"{arch} patch product")


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_the_switched_patch_embedding_is_the_product(tiny_model, arch, device):
    """On the device the strategies put it on (moved after loading, as they move it), the switched module computes
    the product: its output is :func:`patch_product`'s bit for bit, and output and gradients are within the float32
    dot-product bound of the float64 convolution (on CUDA: cuBLAS in float32 with TF32 off)."""
    model, _ = load_model(tiny_model(arch))
    (embed,) = patch_embeddings(model)
    embed.to(device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as float32 (the bound is float32's)
    try:
        x = torch.randn(33, embed.proj.weight[0].numel(), generator=torch.Generator().manual_seed(1)).to(device)
        with torch.no_grad():
            assert torch.equal(embed(x), embed_with(embed, patch_product)(x))
        within_the_dot_product_bound(embed, embed, f"{arch} on {device}")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


class OverlappingPatchEmbed(torch.nn.Module):
    """Named like a patch embedding, but its patches overlap (stride 2, kernel 4): a convolution, not a product."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 2, 2))


def test_text_models_and_overlapping_patches_are_left_alone(tiny_model):
    model, _ = load_model(tiny_model("qwen2"))
    assert use_linear_patch_embedding(model) == 0
    assert use_linear_patch_embedding(OverlappingPatchEmbed()) == 0
