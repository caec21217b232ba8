"""Qwen3.5 (hybrid Gated DeltaNet linear attention + full attention; dense and mixture-of-experts) and Qwen3-VL-MoE:
the tiny models reload as hub checkpoints do, generate through the hf engine as the plain forward predicts, train
(train-policy, train-sft) end to end, and the group-shared forward computes each prompt once on each of them (a
cached prompt, not a packed row, where a recurrent layer would carry one response's state into the next) (issue 60)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from launch import QUIET
from PIL import Image
from tolerance import assert_within
from tool_runs import tool_sft, two_tool_steps
from updates import loss_gradients

from data_pipelines.collate import encode_prompt
from data_pipelines.records import PromptRecord
from vlrft.archs import ARCHS
from vlrft.cli import main
from vlrft.models.loading import load_model
from vlrft.models.packing import recurrent_layers, sample_images, shared_forward_kind, shared_prompt_logits
from vlrft.models.processing import ImageOnlyQwen3VLProcessor
from vlrft.models.tiny import CHAT_TEMPLATE
from vlrft.rollout import SamplingParams, make_engine
from vlrft.trainer.experience import response_logprobs, response_tensors

NEW = ("qwen3_5", "qwen3_5_moe", "qwen3_vl_moe")
HYBRID = ("qwen3_5", "qwen3_5_moe")

pytestmark = pytest.mark.skipif(
    not set(NEW) <= set(ARCHS), reason="transformers without Qwen3.5 / Qwen3-VL-MoE (5.24 has them)"
)

# Both sides compute the same float32 sums in another order or batch layout (one sample alone vs right-padded among
# others; the chunked vs the recurrent gated delta rule in decoding): a log-prob of the tiny model is a sum over
# ~1e3 logits and 2 layers of 64-wide dot products of O(1) terms, each reordered sum off by a few ulps (1.2e-7 at
# 1), ~10 along the path: ~1e-6 at worst. 1e-5 is ten times that (tests/test_group_forward.py's bound).
FORWARD_BOUND = 1e-5


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy())


def _prompts(proc) -> list:
    recs = [
        PromptRecord(id="one", prompt="<image> what colour?", images=[_image(1, (64, 96))]),
        PromptRecord(id="text", prompt="A text-only prompt that is a little longer than the others."),
        PromptRecord(id="two", prompt="<image> and <image>: same?", images=[_image(2, (64, 64)), _image(3, (128, 64))]),
    ]
    return [encode_prompt(proc, r) for r in recs]


def _alone(model, prompt, response: torch.Tensor, suppress: list[int] = ()) -> torch.Tensor:
    """The log-softmax ``[R, V]`` predicting ``response`` from one unpadded sequence [prompt | response]: the plain
    per-sample forward, no cache, no padding, no other sample (``suppress``: token ids the engine never samples)."""
    ids = torch.cat([prompt.input_ids, response])[None]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if prompt.mm_token_type_ids is not None:
        inputs["mm_token_type_ids"] = torch.cat([prompt.mm_token_type_ids, torch.zeros_like(response)])[None]
    if prompt.pixel_values is not None:
        inputs.update(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw)
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits[0]
    p = prompt.input_ids.numel()
    picked = logits[p - 1 : p - 1 + response.numel()].double()
    return torch.log_softmax(picked.index_fill(-1, torch.tensor(list(suppress), dtype=torch.long), -torch.inf), -1)


@pytest.mark.parametrize("arch", NEW)
def test_tiny_folder_reloads_with_the_auto_classes_and_load_model(arch, tiny_model):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_model(arch, tool_tokens=True)
    auto = AutoModelForImageTextToText.from_pretrained(path)
    model, proc = load_model(path)
    assert type(model) is type(auto) and type(proc) is type(AutoProcessor.from_pretrained(path))
    assert type(proc) is ImageOnlyQwen3VLProcessor  # no torchvision needed
    assert all(torch.equal(a, b) for a, b in zip(auto.state_dict().values(), model.state_dict().values()))
    text = model.config.get_text_config()
    if arch in HYBRID:
        assert text.layer_types == ["linear_attention", "full_attention"] and recurrent_layers(model) == [0]
    else:
        assert getattr(text, "layer_types", None) in (None, ["full_attention"] * 2) and recurrent_layers(model) == []
    if arch.endswith("moe"):
        assert (text.num_experts, text.num_experts_per_tok) == (4, 2)
    # the same tokenizer and chat template (tool markup included) as the other tiny models
    ref = load_model(tiny_model("qwen2_5_vl", tool_tokens=True), processor=True)[1].tokenizer
    assert proc.tokenizer.get_vocab() == ref.get_vocab() and proc.chat_template == CHAT_TEMPLATE
    assert proc.tokenizer.convert_tokens_to_ids("<tool_call>") == ref.convert_tokens_to_ids("<tool_call>")
    prompt = _prompts(proc)[0]
    assert prompt.image_grid_thw.tolist() == [[1, 6, 4]]  # 96x64 pixels, 16-pixel patches (Qwen3-VL's tower)
    out = _alone(model, prompt, torch.tensor([5, 6, 7]))
    assert out.shape == (3, len(proc.tokenizer)) and torch.isfinite(out).all()
    if arch in HYBRID:  # no fla / causal-conv1d kernels here: transformers' PyTorch gated delta rule computed it
        assert importlib.util.find_spec("fla") is None and importlib.util.find_spec("causal_conv1d") is None


@pytest.mark.parametrize("arch", NEW)
def test_hf_engine_greedy_equals_the_plain_forward_argmax_and_its_logprobs(arch, tiny_model):
    """Prefill once (the hybrid models decline the shared prompt cache: their cache is repeated per sample) and
    plain generate give the same tokens; each is the argmax of the plain per-sample forward, and the engine's
    log-probs are its log-softmax."""
    model, proc = load_model(tiny_model(arch))
    model.eval()
    prompts = _prompts(proc)
    engine = make_engine("hf", model, proc)
    assert engine.prefill_once
    runs = {}
    for once in (True, False):
        engine.prefill_once = once
        runs[once] = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=6, logprobs=True))
    assert [x.response_ids.tolist() for x in runs[True]] == [x.response_ids.tolist() for x in runs[False]]
    worst = 0.0
    for x in runs[True]:
        ref = _alone(model, prompts[x.prompt_index], x.response_ids, engine.suppress)
        assert x.response_ids.tolist() == ref.argmax(-1).tolist()
        got = ref.gather(1, x.response_ids[:, None])[:, 0]
        worst = max(worst, (x.logprobs.double() - got).abs().max().item())
    print(f"{arch}: engine vs plain forward log-probs, max |d| {worst:.2e}")
    assert_within(worst, FORWARD_BOUND, f"{arch}: hf engine log-probs vs the plain per-sample forward")


def _group_batch(proc, index: list[int], seed: int = 0, longest: int = 8):
    """A collated micro-batch of random responses (1 to ``longest - 1`` tokens) to ``_prompts``' prompts ``index``."""
    from data_pipelines.collate import collate_sequences

    prompts = _prompts(proc)
    g = torch.Generator().manual_seed(seed)
    responses = [
        torch.randint(3, 200, (int(torch.randint(1, longest, (1,), generator=g)),), generator=g) for _ in index
    ]
    pad = proc.tokenizer.pad_token_id
    ids, mask = response_tensors(responses, pad)
    return prompts, responses, collate_sequences(prompts, index, responses, pad), ids, mask


@pytest.mark.parametrize("arch", NEW)
def test_group_shared_forward_equals_each_samples_forward_alone(arch, tiny_model):
    """The group-shared forward on each new architecture equals each sample's forward alone (no cache, no padding,
    no other sample). Hybrid models take the cached path (each prompt's forward once, its convolution and recurrent
    states carried into each sample's own continuation), decided from the config's layer types, never a packed row:
    the packed row is measurably wrong there (the recurrent state of one response runs into the next). Qwen3-VL-MoE
    (attention only) packs."""
    model, proc = load_model(tiny_model(arch))
    model.eval()
    index = [0, 2, 0, 1, 2, 0]
    prompts, responses, batch, ids, mask = _group_batch(proc, index, longest=20)
    assert batch["input_ids"].shape[1] > 64  # the plain rows cross the gated delta rule's chunk, prompt + response
    assert shared_forward_kind(model, batch) == ("cached" if arch in HYBRID else "packed")
    with torch.no_grad():
        got, _ = response_logprobs(model, batch, ids, shared=True)
        packed = torch.log_softmax(shared_prompt_logits(model, batch, ids.shape[1], torch.device("cpu")).double(), -1)
    ref = torch.zeros(ids.shape, dtype=torch.float64)
    for i, (p, r) in enumerate(zip(index, responses)):
        ref[i, : r.numel()] = _alone(model, prompts[p], r).gather(1, r[:, None])[:, 0]
    m = mask.bool()
    worst = (got.double() - ref)[m].abs().max().item()
    packed_gap = (packed.gather(2, ids[..., None])[..., 0] - ref)[m].abs().max().item()
    print(f"{arch}: shared=True vs alone {worst:.2e}; the packed row vs alone {packed_gap:.2e}")
    assert_within(worst, FORWARD_BOUND, f"{arch}: log-probs with shared=True vs each sample's forward alone")
    if arch in HYBRID:
        assert packed_gap > 1e-3  # why hybrids never pack
    else:
        assert_within(packed_gap, FORWARD_BOUND, f"{arch}: the packed row vs each sample's forward alone")


# The gradient bound of the cached path. Both paths sum the same per-token float32 terms, each of the size of the
# whole gradient, in another order and chunk layout (transformers' gated delta rule computes in float32 whatever the
# model's dtype, and the prompt and the continuation are two chunkings of the sequence), so each parameter's
# gradient is off by a few ulps of the WHOLE gradient: measured against the whole gradient's norm, the ~1e-6 of
# FORWARD_BOUND's reasoning, and 1e-5 is ten times that. Measured against a parameter's own norm it is not bounded
# by the arithmetic: the decay parameters of a linear-attention layer (A_log, dt_bias) have gradients whose terms
# cancel to ~1e-6 of the whole, so the same absolute rounding is 1e-3..1e-1 of their own norm, and the plain path
# alone, run with another chunk length of transformers' kernel (16 instead of 64), differs from itself that much
# there (measured 5e-4 to 2.4e-2 on two batches of the tiny qwen3_5 and qwen3_5_moe, where the cached path
# differed by 1e-3 to 4e-2; both about 2e-7 of the whole gradient).
GRADIENT_BOUND = 1e-5


@pytest.mark.parametrize("arch", NEW)
def test_group_shared_forward_gradients_equal_the_plain_forwards(arch, tiny_model):
    """The policy loss's gradient (log-probs and entropy) through the group-shared forward reaches every parameter
    the plain path's does (the hybrids: through the carried states into the prompt's forward and the vision tower)
    and equals it within GRADIENT_BOUND of the whole gradient; Qwen3-VL-MoE (the packed row, attention only) also
    within the per-parameter relative bound of tests/test_group_forward.py. Each prompt, its images included, is
    computed once per micro-batch (counted with forward hooks on the real embedding and vision tower)."""
    model, proc = load_model(tiny_model(arch))
    model.train()
    index = [0, 1, 0, 2, 2, 0, 1]
    _, _, batch, ids, mask = _group_batch(proc, index, seed=1, longest=12)
    adv = torch.randn(ids.shape[0], 1, generator=torch.Generator().manual_seed(5)).expand_as(ids)
    tokens: list[int] = []
    patches: list[int] = []
    text = model.model.language_model
    hooks = [
        text.embed_tokens.register_forward_hook(lambda mod, args, out: tokens.append(args[0].numel())),
        model.model.visual.register_forward_hook(lambda mod, args, out: patches.append(args[0].shape[0])),
    ]
    try:
        gs, gp = (loss_gradients(model, batch, ids, mask, adv, shared=x, entropy_coef=0.01) for x in (True, False))
    finally:
        for h in hooks:
            h.remove()
    assert set(gs) == set(gp) and any(k.startswith("model.visual") for k in gs)
    assert any(".linear_attn." in k for k in gs) == (arch in HYBRID)
    assert any(".experts." in k for k in gs) == arch.endswith("moe")
    whole = torch.sqrt(sum((g.double() ** 2).sum() for g in gp.values())).item()
    worst = max((gs[k] - gp[k]).double().norm().item() for k in gp) / whole
    own = max(((gs[k] - gp[k]).norm() / gp[k].norm().clamp_min(1e-30)).item() for k in gp if gp[k].norm() > 0)
    print(f"{arch}: {len(gp)} parameters; worst gradient difference {worst:.2e} of the whole gradient ({own:.2e} of")
    print(f"  the parameter's own norm); tokens through the text model {tokens}, image patches {patches}")
    assert_within(worst, GRADIENT_BOUND, f"{arch}: shared vs plain gradients, worst parameter, of the whole gradient")
    prompt_len, resp_len = batch["prompt_lengths"], batch["response_lengths"]
    firsts = [index.index(p) for p in sorted(set(index))]
    once = sample_images(batch, firsts)
    assert patches == [once["pixel_values"].shape[0], batch["pixel_values"].shape[0]]
    if arch not in HYBRID:  # attention only: the bound of tests/test_group_forward.py, each parameter's own norm
        assert_within(own, FORWARD_BOUND, f"{arch}: shared vs plain gradients, worst relative to the parameter's own")
        return
    longest_prompt, longest_response = int(prompt_len[firsts].max()), int(resp_len.max())
    # cached: the 3 prompts once (left-padded to the longest), then each sample's response but its last token
    assert tokens == [3 * longest_prompt, len(index) * (longest_response - 1), batch["input_ids"].numel()]


def test_cached_group_forward_is_declined_under_gradient_checkpointing(tiny_model):
    """A block called with a cache is not checkpointed (``vlrft.strategies.blocks``), so with
    ``strategy.gradient_checkpointing`` a hybrid model's update takes the plain rows (the memory the user asked to
    save is kept); inference (old and reference log-probs, no gradient) still computes each prompt once."""
    from vlrft.strategies.blocks import own_block_forwards

    model, proc = load_model(tiny_model("qwen3_5"))
    _, _, batch, _, _ = _group_batch(proc, [0, 0, 1])
    own_block_forwards(model, compile=False, checkpoint=True)
    model.train()
    assert shared_forward_kind(model, batch) is None
    with torch.no_grad():
        assert shared_forward_kind(model, batch) == "cached"
    model.eval()
    assert shared_forward_kind(model, batch) == "cached"


@pytest.mark.parametrize("arch", NEW)
def test_train_policy_and_train_sft_two_steps(arch, tiny_model, tmp_path):
    path = tiny_model(arch)
    small = ["data.synthetic_train_size=8", "data.synthetic_eval_size=4", "train.max_steps=2", "train.eval_every=0"]
    rc = main(
        ["train-policy", f"model.path={path}", f"train.output_dir={tmp_path / 'rl'}", *small, *QUIET]
        + ["rollout.rollout_batch_size=2", "rollout.max_new_tokens=4", "optim.lr=1e-3"]
    )
    assert rc == 0
    rows = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/combined" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["train/grad_norm"] > 0 for r in steps)
    assert (tmp_path / "rl" / "final" / "model.safetensors").is_file()
    rc = main(["train-sft", f"model.path={path}", f"train.output_dir={tmp_path / 'sft'}", *small, *QUIET])
    assert rc == 0
    rows = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    nll = [r["eval/nll"] for r in rows if "eval/nll" in r]
    assert [r["step"] for r in rows if "eval/nll" in r] == [0, 2] and nll[1] < nll[0]
    # every parameter trained: the linear-attention layer's and every expert's too (Adam moves any nonzero gradient)
    before, _ = load_model(path, processor=False)
    after, _ = load_model(tmp_path / "sft", processor=False)
    old = dict(before.named_parameters())
    frozen = [n for n, p in after.named_parameters() if torch.equal(p, old[n])]
    print(f"{arch}: sft held-out nll {nll[0]:.3f} -> {nll[1]:.3f}; unchanged parameters: {frozen}")
    assert frozen == []


@pytest.mark.parametrize("arch", [a for a in NEW if a.startswith("qwen3_5")])
def test_eager_attention_decodes_like_sdpa_and_the_static_cache_is_declined(arch, tiny_model):
    """Eager attention repeats the prefilled cache per sample, linear-attention states included (transformers' own
    ``batch_repeat_interleave`` does not exist for them: it raised AttributeError); the static-cache decode holds keys
    and values only, so ``compile: auto`` declines it for these models and ``compile: on`` is one line."""
    from vlrft.config import ConfigError
    from vlrft.rollout.hf import HFEngineConfig

    model, proc = load_model(tiny_model(arch))
    model.eval()
    prompts = _prompts(proc)
    sampling = SamplingParams(n=2, temperature=0, max_new_tokens=6)
    sdpa = [x.response_ids.tolist() for x in make_engine("hf", model, proc).generate(prompts, sampling)]
    model.set_attn_implementation("eager")
    eager = [x.response_ids.tolist() for x in make_engine("hf", model, proc).generate(prompts, sampling)]
    assert eager == sdpa
    assert not make_engine("hf", model, proc, hf=HFEngineConfig(inference_copy="off", compile="auto")).static_cache
    with pytest.raises(ConfigError, match=r"rollout.hf.compile=on: the static-cache decode holds keys and values"):
        make_engine("hf", model, proc, hf=HFEngineConfig(inference_copy="off", compile="on"))


def test_lora_reaches_qwen3_5s_linear_attention_projections(tiny_model):
    """The default LoRA targets adapt Qwen3.5's linear-attention projections too (in_proj_qkv, in_proj_z, out_proj),
    beside the full-attention and MLP ones; the dense architectures have none of those names."""
    from vlrft.strategies import OptimConfig, StrategyConfig, make_strategy

    strategy = make_strategy(StrategyConfig(lora_rank=4), OptimConfig(lr=1e-3))
    strategy.prepare(load_model(tiny_model("qwen3_5"))[0], total_steps=1)
    adapted = {n.split(".")[-2] for n, _ in strategy.unwrap().named_modules() if n.endswith("lora_A")}
    assert {"in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "o_proj", "down_proj"} <= adapted, adapted


@pytest.mark.slow
@pytest.mark.parametrize("arch", NEW)
def test_train_sft_learns_the_colour_task(arch, tiny_model, tmp_path):
    """Learning proof (issue 60): train-sft's embedded defaults (colour demonstrations, 60 steps) on each new tiny
    architecture take held-out greedy accuracy from <= 0.3 to >= 0.95 (measured: 0.0 -> 1.0 on all three, nll 6.97
    -> ~0.01, 17-19 s each on a 2-core Xeon)."""
    out = tmp_path / "sft"
    assert main(["train-sft", f"model.path={tiny_model(arch)}", f"train.output_dir={out}", *QUIET]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    assert evals[0] <= 0.3 and evals[60] >= 0.95, evals


# GRPO from scratch on each new arch: train-policy's embedded default plus these. Qwen3.5 at the default lr 2e-3
# stayed at 0.75 on seed 0 (one colour never named; also with entropy_coef 0.02). The MoE policies as the default is,
# with the router's load-balancing loss (the config's 0.001) on the group-shared forward
GRPO_FROM_SCRATCH = {"qwen3_5": ["optim.lr=1e-3"], "qwen3_5_moe": [], "qwen3_vl_moe": []}


@pytest.mark.slow
@pytest.mark.parametrize("arch", NEW)
def test_grpo_learns_the_colour_task_on_each_new_arch_from_scratch(arch, tmp_path):
    """Learning proof (issue 60): train-policy's embedded GRPO default (colour task, 200 steps) on each new tiny
    random architecture (:data:`GRPO_FROM_SCRATCH`) takes held-out greedy accuracy from <= 0.3 to >= 0.95 at every
    evaluation from step 120 on. Measured on the 2-core Xeon (evaluations every 10 steps), the first step at 1.0,
    held to step 200 in every run (docs/tiny-models.md): Qwen3.5 90 / 40 / 90 (seeds 0, 1, 2) and 90 (seed 0 under
    MKL_CBWR=COMPATIBLE); Qwen3.5-MoE 90 / 70 / 50 and 90; Qwen3-VL-MoE 80 / 50 / 40 and 80. 60-90 s each."""
    out = tmp_path / "rl"
    args = ["train-policy", f"model.tiny_arch={arch}", *GRPO_FROM_SCRATCH[arch], "train.eval_every=20"]
    assert main([*args, f"train.output_dir={out}", *QUIET]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    print(f"{arch} GRPO held-out accuracy: {evals}")
    assert evals[0] <= 0.3 and all(evals[s] >= 0.95 for s in range(120, 201, 20)), evals


@pytest.mark.parametrize("arch", NEW)
def test_train_dpo_train_reward_model_and_eval_run_on_each_new_arch(arch, tiny_model, tmp_path):
    """Issue 60, item 2: train-dpo, train-reward-model (scalar head and judge) two steps each, and ``vlrft eval`` on
    held-out colour records, on each new architecture (hybrid linear attention, experts) from its folder."""
    from data_pipelines.synthetic import make_prompt_records, write_prompt_records

    path = tiny_model(arch)
    small = ["data.synthetic_train_size=8", "data.synthetic_eval_size=4", "train.max_steps=2", "train.batch_size=2"]
    common = [f"model.path={path}", "optim.lr=1e-3", *small, *QUIET]
    assert main(["train-dpo", *common, f"train.output_dir={tmp_path / 'dpo'}"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/preference_accuracy" in r] == [0, 2]
    for kind in ("srm", "grm"):
        run = tmp_path / f"rm-{kind}"
        assert main(["train-reward-model", f"model.kind={kind}", *common, f"train.output_dir={run}"]) == 0, kind
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        trained = [r for r in rows if "train/loss" in r]  # the log of the 2 steps (logged at the last)
        assert [r["step"] for r in trained] == [2] and trained[0]["train/grad_norm"] > 0, kind
        assert [r["step"] for r in rows if "eval/n" in r] == [0, 2] and (run / "final").is_dir(), kind
    data = write_prompt_records(make_prompt_records("color", 4, seed=10_000), tmp_path / "held_out.jsonl")
    args = ["eval", "--benchmark", "colors", "--verifier", "vocab_answer", "--model", str(path)]
    assert (
        main([*args, "--data", str(data), "--out", str(tmp_path / "eval"), "--max-new-tokens", "2", "--no-progress"])
        == 0
    )
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["num_problems"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_vl_moe"])
def test_multi_turn_tools_on_each_new_arch_from_tool_demonstrations(arch, tmp_path):
    """Issue 60, item 2 (multi-turn tools): each new architecture, built with Qwen's tool tokens, learns the zoom
    tool's call format from 60 steps of train-sft on the tool demonstrations (configs/sft/zoom_tools.yaml), then
    train-policy (configs/policy/zoom_tools.yaml) runs two steps of multi-turn trajectories on it through the hf engine:
    the policy calls zoom, the tool's image comes back as the next turn's image (such responses hold images of their
    own, so the update takes the plain rows), and samples.jsonl shows each turn. The slow suite keeps the two MoE
    archs: dense Qwen3.5 has Qwen3.5-MoE's linear-attention layers and vision tower with a dense MLP (measured on it
    as well on 2026-12-03: 1.0 and 1.125 calls a trajectory)."""
    model = tool_sft(tmp_path / "sft", f"model.tiny_arch={arch}")
    out = tmp_path / "rl"
    rows = two_tool_steps(model, out, "train.eval_every=0")
    steps = [r for r in rows if "tools/calls" in r and "reward/combined" in r]
    print(arch, [(r["tools/calls/zoom"], r["tools/images"]) for r in steps])
    # each step's trajectories call zoom, each call answered by an image (measured 0.5-1.125 calls a trajectory on
    # the three archs; a rate of 8 samples, so the bar is 2 of them)
    assert len(steps) == 2 and all(r["tools/images"] == r["tools/calls/zoom"] >= 0.25 for r in steps), steps
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert any(
        s["tool_calls"] == {"zoom": 1} and s["turns"][0]["observations"] == [{"text": "", "images": 1}] for s in samples
    )
