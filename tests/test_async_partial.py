"""Partial rollouts (``rollout.asynchronous.partial``, issue 59 item 4): a version that lands mid-generation is loaded
between two decode steps and draws the rest of the responses.

- on the hf engine with a real tiny Qwen2.5-VL and keyed sampling: a hook that loads other weights at decode step k
  leaves the first k tokens a plain generation's, their reported log-probs the old model's recomputed ones, and
  records ``[v0] * k + [v1] * (R - k)``; each later token's reported log-prob is that of the distribution it was drawn
  from (the new weights reading the old weights' KV cache, recomputed by hand); a version landing before the prefill
  draws what the new model draws;
- a group's version is its oldest token's, and the trainer's metrics count tokens per version lag;
- under torchrun (1 rollout + 1 trainer rank), partial on: some samples carry two versions, the staleness bound
  holds and the run ends cleanly; partial off: one version per sample, as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from launch import run_job, subprocess_env, torchrun
from PIL import Image
from tolerance import assert_within

from data_pipelines.collate import EncodedPrompt, collate_sequences, encode_prompt
from data_pipelines.records import PromptRecord
from vlrft.config import ConfigError, load_config
from vlrft.models.loading import load_model
from vlrft.rollout import Rollout, SamplingParams, make_engine
from vlrft.rollout.base import sampling_key, vision_token_ids
from vlrft.rollout.hf import HFEngineConfig
from vlrft.rollout.hf_engine import CACHE
from vlrft.trainer.async_rl import flat_buffers, load_buffers, oldest_version, stream_layout, token_staleness
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.experience import ScoredGroup, response_logprobs, response_tensors

PLAIN = HFEngineConfig(inference_copy="off", compile="off")
# the engine's log-probs against the same weights computed in another layout (another batch, a KV cache read instead
# of a full forward): float32 sums in another order, whose rounding (~6e-8 relative per operation, over the layers and
# the logits' magnitude of the perturbed weights, ~30) reaches a few 1e-6; the bound the vLLM tests use for an
# engine's log-probs against the trainer's, 1e-4, leaves the measured value at a tenth or less
LOGP_TOL = 1e-4
KEYS = [sampling_key(7, 1, x) for x in "abcd"]


@pytest.fixture(scope="module")
def policy(tiny_model):
    """The tiny policy's folder, its processor and a second version of its weights (the update that lands)."""
    path = str(tiny_model("qwen2_5_vl"))
    model, processor = load_model(path, "float32")
    g = torch.Generator().manual_seed(5)
    new = {n: p.detach() + 0.2 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    return path, processor, new


def _fresh(path: str) -> torch.nn.Module:
    return load_model(path, "float32")[0].eval()


class LoadAt:
    """The engine's hook loading ``new`` into ``model`` in place at its call ``k`` (call 0: before the prefill; call
    t + 1: after decode step t's forward), as a rollout rank does when a version arrives: tokens 0..k-1 are version
    0's, the others version 1's."""

    def __init__(self, model: torch.nn.Module, new: dict[str, torch.Tensor], k: int):
        self.model, self.k, self.calls, self.version = model, k, 0, 0
        self.layout = stream_layout(model)
        self.buffers = flat_buffers(self.layout, new, torch.device("cpu"))

    def __call__(self) -> int:
        if self.calls == self.k:
            load_buffers(self.model, self.layout, self.buffers)
            self.version = 1
        self.calls += 1
        return self.version


def _prompts(processor) -> list[EncodedPrompt]:
    records = [
        PromptRecord(id="a", prompt="red green blue"),
        PromptRecord(id="b", prompt="What colour? <image>", images=[Image.new("RGB", (56, 84), (255, 0, 0))]),
        PromptRecord(id="c", prompt="A much longer text-only prompt, so that the others are left-padded to it."),
        PromptRecord(id="d", prompt="<image> and <image>", images=[Image.new("RGB", (112, 112), (0, 0, 255))] * 2),
    ]
    return [encode_prompt(processor, r) for r in records]


def test_a_version_landing_at_step_k_draws_the_rest_of_the_responses(policy):
    path, processor, new = policy
    prompts, k = _prompts(processor), 4
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, logprobs=True, keys=KEYS)
    model = _fresh(path)
    engine = make_engine("hf", model, processor, hf=PLAIN)
    plain = engine.generate(prompts, sampling)
    assert all(x.versions is None for x in plain)  # no hook: one version drew them all
    engine.between_steps = LoadAt(model, new, k)
    got = engine.generate(prompts, sampling)
    lengths = [x.response_ids.numel() for x in got]
    assert min(lengths) > k and [x.logprobs.numel() for x in got] == lengths
    for x, y in zip(got, plain):
        assert x.response_ids[:k].tolist() == y.response_ids[:k].tolist()  # keyed: the same draws until the load
        assert x.versions.dtype == torch.int64 and x.versions.tolist() == [0] * k + [1] * (len(x.response_ids) - k)
    assert any(x.response_ids[k:].tolist() != y.response_ids[k:].tolist() for x, y in zip(got, plain))
    # the first k reported log-probs are the old model's, recomputed as the trainer does; the later ones are not
    responses, index = [x.response_ids for x in got], [x.prompt_index for x in got]
    batch = collate_sequences(prompts, index, responses, processor.tokenizer.pad_token_id)
    ids, mask = response_tensors(responses, processor.tokenizer.pad_token_id)
    suppress = torch.tensor(vision_token_ids(processor.tokenizer))
    with torch.no_grad():
        old, _ = response_logprobs(_fresh(path), batch, ids, suppress=suppress)
    reported = torch.zeros_like(old)
    for i, x in enumerate(got):
        reported[i, : x.logprobs.numel()] = x.logprobs
    before = torch.zeros_like(mask, dtype=torch.bool)
    before[:, :k] = True
    assert_within((reported - old)[before].abs().max(), LOGP_TOL, "the first k tokens' log-probs vs the old model's")
    assert float((reported - old)[mask.bool() & ~before].abs().max()) > 1e-2  # the new weights drew the rest


def test_a_later_tokens_log_prob_is_the_new_weights_reading_the_old_cache(policy):
    """Token k onward: the forward of version 1 over the KV cache version 0 computed for the prompt and tokens before
    (the cache is not recomputed), recomputed by hand on one unpadded text prompt."""
    path, processor, new = policy
    prompt = encode_prompt(processor, PromptRecord(id="a", prompt="red green blue"))
    k, t = 3, 0.9
    model = _fresh(path)
    engine = make_engine("hf", model, processor, hf=PLAIN)
    engine.between_steps = LoadAt(model, new, k)
    (x,) = engine.generate([prompt], SamplingParams(n=1, temperature=t, max_new_tokens=9, logprobs=True, keys=KEYS[:1]))
    r = x.response_ids.numel()
    assert r > k + 2 and x.versions.tolist() == [0] * k + [1] * (r - k)
    seq = torch.cat([prompt.input_ids.reshape(-1), x.response_ids])[None]
    p = prompt.input_ids.numel()
    ref = _fresh(path)

    def drawn(logits: torch.Tensor) -> torch.Tensor:  # the drawn tokens' log-probs (tempered, vision suppressed)
        logits = logits.float() / t
        logits[:, vision_token_ids(processor.tokenizer)] = -torch.inf
        return torch.log_softmax(logits, -1).gather(-1, x.response_ids[:, None]).squeeze(-1)

    with torch.no_grad():
        # version 0 computes the cache of the prompt and tokens 0..k-2 (and the scores of tokens 0..k-1) ...
        first = ref(input_ids=seq[:, : p + k - 1], use_cache=True)
        load_buffers(ref, stream_layout(ref), flat_buffers(stream_layout(ref), new, torch.device("cpu")))
        # ... version 1 reads token k-1 onward over that cache
        later = ref(input_ids=seq[:, p + k - 1 : p + r - 1], **{CACHE: getattr(first, CACHE)}, use_cache=True)
        recomputed = ref(input_ids=seq[:, : p + r - 1], use_cache=False)  # version 1 over everything
    want = drawn(torch.cat([first.logits[0, p - 1 :], later.logits[0]]))
    assert_within((x.logprobs - want).abs().max(), LOGP_TOL, "the mixed policy's log-probs vs the engine's")
    # not the new weights' own log-probs: the cache version 0 computed is read, not recomputed
    assert float((x.logprobs - drawn(recomputed.logits[0, p - 1 :]))[k:].abs().max()) > 1e-3


def test_a_version_landing_before_the_prefill_draws_what_the_new_model_draws(policy):
    path, processor, new = policy
    prompts = _prompts(processor)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, logprobs=True, keys=KEYS)
    updated = _fresh(path)
    load_buffers(updated, stream_layout(updated), flat_buffers(stream_layout(updated), new, torch.device("cpu")))
    want = make_engine("hf", updated, processor, hf=PLAIN).generate(prompts, sampling)
    model = _fresh(path)
    engine = make_engine("hf", model, processor, hf=PLAIN, micro_rollout_batch_size=1)
    engine.between_steps = LoadAt(model, new, 0)
    got = engine.generate(prompts, sampling)
    assert [x.response_ids.tolist() for x in got] == [x.response_ids.tolist() for x in want]
    assert all(x.versions.tolist() == [1] * x.response_ids.numel() for x in got)
    assert_within(max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(got, want)), LOGP_TOL, "log-probs")


def _group(versions: list[list[int] | None], version: int) -> ScoredGroup:
    rollouts = [
        Rollout(
            0, torch.ones(len(v) if v else 3, dtype=torch.long), "", "stop", versions=torch.tensor(v) if v else None
        )
        for v in versions
    ]
    n = len(rollouts)
    return ScoredGroup(
        PromptRecord(id="a", prompt="x"),
        EncodedPrompt(torch.ones(2, dtype=torch.long)),
        rollouts,
        torch.zeros(n),
        {},
        version,
    )


def test_a_groups_version_is_its_oldest_tokens_and_tokens_are_counted_per_lag():
    mixed = _group([[4, 4, 5, 5, 5], [5, 5]], 4)
    assert oldest_version(mixed.rollouts, 3) == 4
    assert oldest_version(_group([[5, 5], [5]], 4).rollouts, 4) == 5  # a later micro-batch: all of it newer
    assert oldest_version(_group([None, None], 4).rollouts, 4) == 4  # no versions: the one that drew them
    whole = _group([None, None], 4)  # partial off: each token counted at its group's lag
    tokens, share = token_staleness([mixed, whole], step=5)
    assert dict(tokens) == {1: 2 + 6, 0: 3 + 2} and share == 0.25


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.engine=vllm"],
            "rollout.asynchronous.partial=true: loads weights between the decode steps of the hf",
        ),
        (["tools.names=[zoom]"], "rollout.asynchronous.partial=true: not with tools"),
    ],
)
def test_partial_rollouts_elsewhere_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(PolicyTrainConfig, None, ["rollout.mode=async", "rollout.asynchronous.partial=true", *overrides])
    assert not load_config(PolicyTrainConfig, None, ["rollout.mode=async"]).rollout.asynchronous.partial


def _async_run(out: Path, partial: bool, port_offset: int) -> list[dict]:
    """A 4-step colour-task run with one rollout and one trainer rank and staleness 1 whose rollouts take several times
    the trainer's update (64 samples of up to 48 tokens a step, generated one prompt at a time: 16 x 48 decode steps of
    4 rows), so that each update lands while the next step generates. Its metrics rows."""
    cmd = torchrun(
        "-m",
        "vlrft",
        "train-policy",
        "rollout.mode=async",
        "rollout.asynchronous.max_staleness=1",
        f"rollout.asynchronous.partial={str(partial).lower()}",
        f"train.output_dir={out}",
        "train.max_steps=4",
        "train.eval_every=0",
        "data.synthetic_eval_size=8",
        "rollout.rollout_batch_size=16",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=48",
        "rollout.micro_rollout_batch_size=1",
        "logging.wandb=disabled",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        nproc=2,
        port_offset=port_offset,
    )
    res = run_job(cmd, env=subprocess_env(), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "Traceback" not in res.stderr and "alarm" not in res.stdout, res.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "async/staleness_max" in r]


@pytest.mark.slow
@pytest.mark.distributed
def test_partial_rollouts_load_the_update_mid_generation(tmp_path):
    """Partial on: the update of step s lands while step s + 1 generates, so some samples carry two versions; a
    group is as old as its oldest token, which the bound still holds; the run ends cleanly."""
    steps = _async_run(tmp_path, True, port_offset=71)
    assert len(steps) == 4 and max(r["async/staleness_max"] for r in steps) <= 1
    assert any(r["async/partial_share"] > 0 for r in steps), [r["async/partial_share"] for r in steps]
    assert sum(r["async/partial_loads"] for r in steps) >= 1
    for r in steps:
        assert r["async/tokens_at_staleness/0"] + r["async/tokens_at_staleness/1"] > 0
