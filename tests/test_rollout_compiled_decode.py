"""The hf engine's static-cache decode (``rollout.hf.compile``): the prefill once per prompt is copied into a static
KV cache, which ``generate`` compiles into a captured decode step on CUDA; on CPU the same path runs eagerly and
samples exactly what the dynamic cache does."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import StaticCache

from data_pipelines.collate import encode_prompt
from data_pipelines.records import PromptRecord
from vlrft.models.loading import load_model
from vlrft.rollout import HFEngineConfig, SamplingParams, make_engine
from vlrft.rollout.hf_engine import STATIC_CACHE_BUCKET

COMPILED = HFEngineConfig(inference_copy="on", compile="on")


def _prompts(proc, vl: bool):
    recs = [
        PromptRecord(id="b", prompt="Text only, a longer prompt than the others."),
        PromptRecord(id="c", prompt="Hi"),
    ]
    if vl:
        recs.append(
            PromptRecord(id="a", prompt="What colour? <image>", images=[Image.new("RGB", (56, 84), (255, 0, 0))])
        )
    return [encode_prompt(proc, r) for r in recs]


def _tokens(engine, prompts, sampling, seed: int = 0) -> list[list[int]]:
    torch.manual_seed(seed)
    return [x.response_ids.tolist() for x in engine.generate(prompts, sampling)]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2"])
def test_the_static_cache_samples_what_the_dynamic_cache_does(tiny_model, arch):
    """Left-padded prompts of different lengths (and an image), greedy and sampled, n = 3: the same tokens, token for
    token; the engine really decodes on a StaticCache of bucketed length holding the prefill."""
    model, proc = load_model(tiny_model(arch))
    model.eval()
    prompts = _prompts(proc, arch != "qwen2")
    plain = make_engine("hf", model, proc)
    static = make_engine("hf", model, proc, hf=COMPILED)
    assert static.static_cache and static.copy is not None and not plain.static_cache
    seen = []
    original = static.model.generate

    def generate(**kwargs):  # what generate is handed (the cache) is recorded, nothing is changed
        seen.append(kwargs.get("cache", kwargs.get("past_key_values")))
        return original(**kwargs)

    static.model.generate = generate
    for sampling in (SamplingParams(n=3, temperature=0.0, max_new_tokens=12), SamplingParams(n=3, max_new_tokens=12)):
        ours, ref = _tokens(static, prompts, sampling), _tokens(plain, prompts, sampling)
        assert ours == ref
        assert sum(map(len, ours)) >= len(ours) * 4
    cache = seen[0]
    assert isinstance(cache, StaticCache) and cache.layers[0].max_cache_len % STATIC_CACHE_BUCKET == 0
    assert cache.layers[0].keys.shape[0] == 3 * len(prompts)  # the prefill expanded to n samples per prompt


def test_auto_compiles_only_with_cuda_and_a_copy():
    auto = HFEngineConfig()
    assert auto.wants_static_cache(copy=True) == torch.cuda.is_available()
    assert not auto.wants_static_cache(copy=False)
    assert not HFEngineConfig(compile="off").wants_static_cache(copy=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled decode (torch.compile + CUDA graphs) needs CUDA")
def test_compiled_decode_on_cuda_matches_eager_greedy(tiny_model):
    """On a GPU: the copy (float32 here, for exact greedy agreement) decodes through generate's compiled call (the
    model's ``_compiled_call`` exists after the first generate) and gives the eager dynamic-cache tokens."""
    model, proc = load_model(tiny_model("qwen2_5_vl"), device="cuda")
    model.eval()
    prompts = _prompts(proc, vl=True)
    plain = make_engine("hf", model, proc)
    compiled = make_engine("hf", model, proc, hf=HFEngineConfig(inference_copy="on", dtype="float32"))
    assert compiled.static_cache and compiled.copy is not None
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=16)
    for _ in range(2):  # the second call reuses the captured graph
        assert _tokens(compiled, prompts, greedy) == _tokens(plain, prompts, greedy)
    assert hasattr(compiled.model, "_compiled_call")
