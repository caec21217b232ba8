"""oneDNN linear layers on the CPU (``strategy.cpu_matmul``, ``vlrft/models/cpu_matmul.py``): the product and its
gradients against float64 within float32's bound for a dot product, the layers a strategy swaps, the fall-backs, and
the policy sampling the same tokens with either kernel. The update under single, FSDP2 and ZeRO-3 with oneDNN against
the one-process MKL update: tests/test_policy_distributed.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import PINNED
from tolerance import assert_within

from vlrft.models import cpu_matmul
from vlrft.models.cpu_matmul import (
    OneDNNLinear,
    onednn_available,
    onednn_faster,
    onednn_linear,
    onednn_matmul,
    use_onednn_linears,
)
from vlrft.models.loading import load_model
from vlrft.rollout import HFEngineConfig, SamplingParams, make_engine
from vlrft.strategies import OptimConfig, StrategyConfig, make_strategy

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from vllm_sync import make_prompts, trainer_logprobs  # noqa: E402

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this PyTorch has no oneDNN float32 linear kernel")

U = 2.0**-24  # float32's unit roundoff


def _gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): a float32 dot product of length n, summed in any order, is within
    gamma_n * sum |a_i b_i| of the exact one (Accuracy and Stability of Numerical Algorithms, eq. 3.5)."""
    return n * U / (1 - n * U)


def _worst_ratio(got: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor, n: int) -> float:
    """The largest error over its elementwise bound gamma_n * (|A| |B|)."""
    return ((got.double() - exact).abs() / (_gamma(n) * scale + 1e-300)).max().item()


@pytest.mark.parametrize("bias", [True, False])
def test_the_product_and_its_gradients_are_float64_within_the_dot_product_bound(bias):
    """Forward ``x W^T + b``, and backward ``g W`` (length: out features), ``g^T x`` (length: tokens), ``sum g``,
    each within its gamma_n bound of the float64 result on the same float32 inputs; the error, like MKL's, sits far
    below it (a bound for the worst case of every rounding going one way; a few sqrt(n) ulps in practice)."""
    gen = torch.Generator().manual_seed(0)
    tokens, fin, fout = 2 * 37, 96, 160  # a 3-D input of 2 rows, odd sizes (no vector-width multiples)
    x = torch.randn(2, tokens // 2, fin, generator=gen)
    w = torch.randn(fout, fin, generator=gen) / fin**0.5
    b = torch.randn(fout, generator=gen) if bias else None
    g = torch.randn(2, tokens // 2, fout, generator=gen)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    bs = b.clone().requires_grad_() if bias else None
    y = onednn_linear(xs, ws, bs)
    y.backward(g)
    x64, w64, g64 = x.double(), w.double(), g.double()
    exact = F.linear(x64, w64, b.double() if bias else None)
    # the bias adds one more rounding: n = fin + 1 terms
    scale = x64.abs() @ w64.abs().t() + (b.double().abs() if bias else 0)
    rows, x2 = g64.reshape(-1, fout), x64.reshape(-1, fin)
    ratios = {
        "forward": _worst_ratio(y.detach(), exact, scale, fin + 1),
        "grad x": _worst_ratio(xs.grad, g64 @ w64, g64.abs() @ w64.abs(), fout),
        "grad W": _worst_ratio(ws.grad, rows.t() @ x2, rows.abs().t() @ x2.abs(), tokens),
    }
    if bias:
        ratios["grad b"] = _worst_ratio(bs.grad, rows.sum(0), rows.abs().sum(0), tokens)
    for what, ratio in ratios.items():
        assert_within(ratio, 1.0, f"oneDNN linear, {what}: error / its gamma_n bound")
    assert y.shape == (2, tokens // 2, fout)


def test_the_batched_product_and_its_gradients_are_float64_within_the_dot_product_bound():
    """``onednn_matmul(a, b)``, one oneDNN product per batch element (the attention's products over a shared
    prompt), forward ``a b`` (length k) and backward ``g b^T`` (length n), ``a^T g`` (length m), each within its
    gamma_n bound of float64 on the same float32 inputs; products below its size threshold, other batch shapes and
    float64 inputs are ``torch.matmul``'s, bit for bit."""
    gen = torch.Generator().manual_seed(2)
    m, k, n = 161, 97, 290  # 4.5 M multiply-adds per product: above MATMUL_MIN_MACS; odd sizes
    assert m * k * n >= cpu_matmul.MATMUL_MIN_MACS
    a = torch.randn(2, 3, m, k, generator=gen)
    b = torch.randn(2, 3, n, k, generator=gen).transpose(-1, -2)  # a transposed view, as the prompt's keys are
    g = torch.randn(2, 3, m, n, generator=gen)
    a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
    y = onednn_matmul(a_, b_)
    y.backward(g)
    a64, b64, g64 = a.double(), b.double(), g.double()
    ratios = {
        "forward": _worst_ratio(y.detach(), a64 @ b64, a64.abs() @ b64.abs(), k),
        "grad a": _worst_ratio(a_.grad, g64 @ b64.transpose(-1, -2), g64.abs() @ b64.abs().transpose(-1, -2), n),
        "grad b": _worst_ratio(b_.grad, a64.transpose(-1, -2) @ g64, a64.abs().transpose(-1, -2) @ g64.abs(), m),
    }
    for what, ratio in ratios.items():
        assert_within(ratio, 1.0, f"oneDNN batched product, {what}: error / its gamma_n bound")
    assert y.shape == (2, 3, m, n) and a_.grad.shape == a.shape and b_.grad.shape == b.shape
    with torch.no_grad():  # no autograd: the same products
        assert torch.equal(onednn_matmul(a, b), y.detach())
    small = a[..., :8, :], b[..., :8]  # 8 x 97 x 8 multiply-adds: below the threshold
    assert torch.equal(onednn_matmul(*small), torch.matmul(*small))
    assert torch.equal(onednn_matmul(a, b[:1]), torch.matmul(a, b[:1]))  # broadcast batch: torch.matmul
    assert torch.equal(onednn_matmul(a.double(), b.double()), torch.matmul(a.double(), b.double()))


def test_the_shared_forward_attends_to_the_prompt_by_onednn_as_by_torch_matmul(tiny_model, monkeypatch):
    """A policy whose layers compute by oneDNN (``use_onednn_linears``) attends to each group's prompt through
    ``onednn_matmul`` in the group-shared forward (its threshold lowered for the tiny model's small products). Against
    the same model with those products back on ``torch.matmul`` (the linear layers by oneDNN in both, so only the
    attention differs; oneDNN against MKL linear layers: the tests above and tests/test_policy_distributed.py): its
    log-probs and every parameter's gradient within 1e-5 (float32 sums reordered, as in tests/test_group_forward.py),
    and the profiler counts six more oneDNN products per text layer, prompt and KV head (two forward, and their two
    gradients each)."""
    from test_group_forward import _batch, _records

    from vlrft.trainer.experience import response_logprobs

    model, proc = load_model(tiny_model("qwen2_5_vl"), torch.float32)
    use_onednn_linears(model)
    attention = [m for m in model.modules() if getattr(m, "is_causal", False)]
    assert attention and all(m.onednn_product for m in attention)
    records = _records(True)
    batch, ids, mask = _batch(proc, records, [2, 3, 5, 1], seed=1)
    adv = torch.randn(ids.shape[0], 1, generator=torch.Generator().manual_seed(0)).expand_as(ids)

    def run(min_macs: int):
        monkeypatch.setattr(cpu_matmul, "MATMUL_MIN_MACS", min_macs)
        model.zero_grad()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            logp, _ = response_logprobs(model, batch, ids, shared=True)
            (-(logp * adv * mask).sum() / mask.sum()).backward()
        calls = sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise")
        return logp.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}, calls

    lp_d, g_d, calls = run(0)  # the prompt's products by oneDNN
    lp_t, g_t, linear_calls = run(1 << 62)  # by torch.matmul
    text = model.config.text_config
    assert calls - linear_calls == 3 * 2 * text.num_hidden_layers * len(records) * text.num_key_value_heads
    m = mask.bool()
    assert_within((lp_d - lp_t)[m].abs().max().item(), 1e-5, "shared forward log-probs, prompt attention by oneDNN")
    assert set(g_d) == set(g_t)
    worst = max(((g_d[k] - g).norm() / g.norm().clamp_min(1e-12)).item() for k, g in g_t.items() if g.norm() > 0)
    assert_within(worst, 1e-5, "shared forward gradients, prompt attention by oneDNN, worst relative difference")


def test_frozen_weights_and_inputs_get_no_gradient_and_other_inputs_fall_back_to_f_linear():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 8, generator=gen), torch.randn(4, 8, generator=gen)
    xg = x.clone().requires_grad_()
    onednn_linear(xg, w).sum().backward()  # a frozen weight: the input's gradient only
    assert torch.allclose(xg.grad, w.sum(0).expand(5, 8), rtol=0, atol=1e-5)
    wg = w.clone().requires_grad_()
    onednn_linear(x, wg).sum().backward()  # the input's gradient is not computed
    assert torch.allclose(wg.grad, x.sum(0).expand(4, 8), rtol=0, atol=1e-5)
    # float64, bf16 and autocast take F.linear itself: bit for bit its result
    for dtype in (torch.float64, torch.bfloat16):
        assert torch.equal(onednn_linear(x.to(dtype), w.to(dtype)), F.linear(x.to(dtype), w.to(dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(onednn_linear(x, w), F.linear(x, w))
        assert onednn_linear(x, w).dtype is torch.bfloat16


def test_strategies_swap_linear_layers_where_asked_and_auto_follows_the_machine(tiny_model):
    folder = tiny_model("qwen2_5_vl")
    linears = sum(isinstance(m, torch.nn.Linear) for m in load_model(folder)[0].modules())
    for setting, swapped in (("onednn", linears), ("mkl", 0)):
        model, _ = load_model(folder)
        strategy = make_strategy(StrategyConfig(cpu_matmul=setting), OptimConfig())
        trained, _, _ = strategy.prepare(model, total_steps=1)
        frozen, _, _ = strategy.prepare(load_model(folder)[0], trainable=False)  # a reference model too
        for m in (trained, frozen):
            assert sum(isinstance(x, OneDNNLinear) for x in m.modules()) == swapped
            assert sum(isinstance(x, torch.nn.Linear) for x in m.modules()) == linears  # still nn.Linear layers
            # the vision tower's patch embedding, computed as a linear product (group_forward.patch_product)
            convs = [x for x in m.modules() if isinstance(x, torch.nn.Conv3d)]
            assert len(convs) == 1 and getattr(convs[0], "onednn_product", False) == (setting == "onednn")
            # the text attention's products over a shared prompt (group_forward._prefix_attention)
            attention = [x for x in m.modules() if getattr(x, "is_causal", False)]
            assert attention and all(getattr(x, "onednn_product", False) == (setting == "onednn") for x in attention)
    # the tests pin torch's kernels at AVX2 on x86 (conftest.py): auto keeps MKL there, so the suite's
    # trajectories do not depend on whether the machine has AVX-512
    if PINNED and torch.backends.cpu.get_cpu_capability() == "AVX2":
        assert not onednn_faster() and not StrategyConfig().onednn
    assert StrategyConfig(cpu_matmul="onednn").onednn and not StrategyConfig(cpu_matmul="mkl").onednn
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(load_model(folder)[0], peft.LoraConfig(r=2, target_modules=["q_proj"]))
    n = use_onednn_linears(lora)  # peft's wrapper stays; the base layer and the adapters inside it are swapped
    assert n == linears + 2 * sum("q_proj" in k and k.endswith("lora_A.default") for k, _ in lora.named_modules())


def test_the_policy_samples_the_same_tokens_with_either_kernel(tiny_model):
    """The hf engine on the training module (one CPU process) and on an inference copy, which computes as the policy
    does: greedy tokens identical to MKL's; on the copy's samples (T = 1) the log-probs under oneDNN and under MKL
    within 1e-5 (the same float32 model through reordered sums: a few ulps of log-probs of ~7, ~1e-6 at worst, as in
    tests/test_rollout_inference_copy.py)."""
    folder = tiny_model("qwen2_5_vl")
    mkl, proc = load_model(folder)
    dnnl, _ = load_model(folder)
    use_onednn_linears(dnnl)
    prompts = make_prompts(proc, "one_image", seed=3)
    copy = make_engine("hf", dnnl, proc, hf=HFEngineConfig(inference_copy="on"))
    assert sum(isinstance(m, OneDNNLinear) for m in copy.copy.modules()) == sum(
        isinstance(m, torch.nn.Linear) for m in mkl.modules()
    )
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=12)
    runs = {
        name: [r.response_ids.tolist() for r in engine.generate(prompts, greedy)]
        for name, engine in (
            ("mkl", make_engine("hf", mkl, proc)),
            ("onednn", make_engine("hf", dnnl, proc)),
            ("copy", copy),
        )
    }
    assert runs["onednn"] == runs["mkl"] == runs["copy"] and sum(map(len, runs["mkl"])) >= 4 * 2 * 4
    torch.manual_seed(11)
    sampled = copy.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=12))
    with torch.no_grad():
        ref, mask = trainer_logprobs(mkl, proc, prompts, sampled, 1.0, suppress=copy.suppress)
        got, _ = trainer_logprobs(dnnl, proc, prompts, sampled, 1.0, suppress=copy.suppress)
    assert int(mask.sum()) >= 4 * 2 * 4
    gap = float((got - ref).abs()[mask.bool()].max())
    assert_within(gap, 1e-5, "sampled tokens' log-probs, oneDNN vs MKL linear layers")
