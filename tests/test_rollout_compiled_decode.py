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
from vlrft.rollout.static_cache import STATIC_CACHE_BUCKET
from vlrft.rollout.static_cache import StaticCaches as _StaticCaches

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


def _cache_addresses(cache: StaticCache) -> list[int]:
    return [t.data_ptr() for layer in cache.layers for t in (layer.keys, layer.values)]


def _recording(engine) -> list:
    """The caches ``engine``'s generate is handed, in order (nothing is changed)."""
    seen, original = [], engine.model.generate

    def generate(**kwargs):
        seen.append(kwargs.get("cache", kwargs.get("past_key_values")))
        return original(**kwargs)

    engine.model.generate = generate
    return seen


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
    seen = _recording(static)
    for sampling in (SamplingParams(n=3, temperature=0.0, max_new_tokens=12), SamplingParams(n=3, max_new_tokens=12)):
        ours, ref = _tokens(static, prompts, sampling), _tokens(plain, prompts, sampling)
        assert ours == ref
        assert sum(map(len, ours)) >= len(ours) * 4
    cache = seen[0]
    assert isinstance(cache, StaticCache) and cache.layers[0].max_cache_len % STATIC_CACHE_BUCKET == 0
    assert cache.layers[0].keys.shape[0] == 3 * len(prompts)  # the prefill expanded to n samples per prompt


def test_static_caches_are_reused_at_the_same_addresses_while_the_weights_stay(tiny_model):
    """A captured decode step replays only where its cache is where it was recorded: with ``sleep_level=0`` the next
    rollout of the same shape (other prompts, after a sleep and a wake) decodes on the same cache tensors, reset, and
    samples exactly what the dynamic cache does; a third shape lets the least recently used of the two held go;
    ``sleep_level=2`` drops them with the weights, and a new cache serves the rollout after the stream."""
    model, proc = load_model(tiny_model("qwen2_5_vl"))
    model.eval()
    first = _prompts(proc, vl=True)
    other = [  # the same rows (3 prompts x 2 samples) and width bucket, other tokens and image
        encode_prompt(proc, PromptRecord(id="d", prompt="Something else entirely, said at some length.")),
        encode_prompt(proc, PromptRecord(id="e", prompt="Yes")),
        encode_prompt(
            proc, PromptRecord(id="f", prompt="<image> Which?", images=[Image.new("RGB", (84, 56), (0, 90, 200))])
        ),
    ]
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=10)
    sampled = SamplingParams(n=2, max_new_tokens=10)
    plain = make_engine("hf", model, proc)
    keep = make_engine("hf", model, proc, hf=HFEngineConfig(inference_copy="on", compile="on", sleep_level=0))
    seen = _recording(keep)
    assert _tokens(keep, first, greedy) == _tokens(plain, first, greedy)
    keep.sleep()
    keep.wake()
    for prompts, sampling in ((other, sampled), (first, greedy)):
        assert _tokens(keep, prompts, sampling, seed=5) == _tokens(plain, prompts, sampling, seed=5)
    assert seen[1] is seen[0] and seen[2] is seen[0]
    assert _cache_addresses(seen[2]) == _cache_addresses(seen[0])
    _tokens(keep, first[:2], greedy)  # 2 prompts: a second shape, held beside the first
    _tokens(keep, first[:1], greedy)  # a third: the first shape (least recently used) is let go
    _tokens(keep, first, greedy)
    assert len({id(c) for c in seen[2:]}) == 4 and _StaticCaches.KEEP == 2

    drop = make_engine("hf", model, proc, hf=HFEngineConfig(inference_copy="on", compile="on", sleep_level=2))
    seen = _recording(drop)
    _tokens(drop, first, greedy)
    drop.sleep()
    drop.wake()
    drop.update_weights(model.named_parameters())
    assert _tokens(drop, first, greedy) == _tokens(plain, first, greedy)
    assert seen[1] is not seen[0]


def test_auto_compiles_only_with_cuda_and_a_copy(tiny_model):
    """Where the policy computes decides, not whether the machine has a GPU: a policy on the CPU of a machine with
    CUDA decodes as on a CPU machine (no copy, no static cache)."""
    auto, cpu, cuda = HFEngineConfig(), torch.device("cpu"), torch.device("cuda", 0)
    assert auto.wants_static_cache(True, cuda) and not auto.wants_static_cache(True, cpu)
    assert not auto.wants_static_cache(False, cuda)
    assert not HFEngineConfig(compile="off").wants_static_cache(True, cuda)
    model, proc = load_model(tiny_model("qwen2_5_vl"))
    engine = make_engine("hf", model, proc, hf=auto)
    assert engine.copy is None and not engine.static_cache and engine.device == cpu


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2"])
def test_a_static_cache_decode_step_traces_as_one_graph(tiny_model, arch):
    """What ``generate`` compiles on CUDA, traced on a CPU (dynamo with the eager backend: the graph, no kernels):
    a decode step of the engine's model (text attention ``packed_sdpa``, grouped KV heads: 4 heads on 2) on a
    static cache of left-padded rows is one graph without a break, and gives the eager step's logits exactly. The
    third H200 run found it broken at every layer's attention (the attention function compiler-disabled whole)."""
    from torch._dynamo.utils import counters

    from vlrft.models.attention_functions import use_packed_attention

    model, proc = load_model(tiny_model(arch))
    model.eval()
    assert use_packed_attention(model) and model.config.get_text_config().num_key_value_heads == 2
    tok = getattr(proc, "tokenizer", proc)
    tok.padding_side = "left"
    enc = tok(["A longer prompt than the other one", "Hi"], return_tensors="pt", padding=True)
    width = enc["input_ids"].shape[1]
    mask = torch.cat([enc["attention_mask"], torch.ones(2, 1, dtype=torch.long)], dim=1)

    def decode_step(call) -> torch.Tensor:
        cache = StaticCache(config=model.config, max_cache_len=STATIC_CACHE_BUCKET)
        with torch.no_grad():
            first = model(**enc, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            step = dict(input_ids=first, attention_mask=mask, cache_position=torch.tensor([width]), use_cache=True)
            return call(**step, past_key_values=cache).logits

    eager = decode_step(model)
    torch._dynamo.reset()
    counters.clear()
    traced = decode_step(torch.compile(model, backend="eager"))
    breaks = {reason.split("\n")[0]: n for reason, n in counters["graph_break"].items()}
    assert not breaks and counters["stats"]["unique_graphs"] == 1, (breaks, dict(counters["stats"]))
    assert torch.equal(traced, eager)
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled decode (torch.compile + CUDA graphs) needs CUDA")
def test_compiled_decode_on_cuda_matches_eager_greedy(tiny_model, monkeypatch):
    """On a GPU: the copy (float32 here, for exact greedy agreement) decodes through generate's compiled call (the
    model's ``_compiled_call`` exists after the first generate) and gives the eager dynamic-cache tokens; the decode
    step is captured as a CUDA graph in the first rollout and replayed in the next two (the weights have not moved
    and the static cache is the same one), where this torch has the method the count wraps (a private API); and
    dynamo breaks no graph on the way."""
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import CUDAGraphTreeManager

    torch._dynamo.reset()
    counters.clear()

    recorded = []
    counted = hasattr(CUDAGraphTreeManager, "record_function")
    if counted:
        original = CUDAGraphTreeManager.record_function

        def record_function(manager, *args, **kwargs):
            recorded.append(1)
            return original(manager, *args, **kwargs)

        monkeypatch.setattr(CUDAGraphTreeManager, "record_function", record_function)
    model, proc = load_model(tiny_model("qwen2_5_vl"), device="cuda")
    model.eval()
    prompts = _prompts(proc, vl=True)
    plain = make_engine("hf", model, proc)
    compiled = make_engine("hf", model, proc, hf=HFEngineConfig(inference_copy="on", dtype="float32"))
    assert compiled.static_cache and compiled.copy is not None
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=16)
    per_rollout = []
    for _ in range(3):
        before = len(recorded)
        assert _tokens(compiled, prompts, greedy) == _tokens(plain, prompts, greedy)
        per_rollout.append(len(recorded) - before)
    assert hasattr(compiled.model, "_compiled_call")
    if counted:
        assert per_rollout[0] >= 1 and per_rollout[1:] == [0, 0], per_rollout
    assert not counters["graph_break"], list(counters["graph_break"])
