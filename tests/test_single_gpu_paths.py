"""Failures first seen on one CUDA GPU (scripts/gpu_check.py), each reproduced here on CPU.

- A tiny VL folder loads its image-only processor even where ``AutoProcessor`` ignores the
  registration (transformers 5.17, the CUDA image's, skips registering a class for a native config and
  silently returned the bare tokenizer).
- FSDP2 on a single process does not shard, so the hf engine embeds each prompt once; that path calls
  the root's embeddings outside the root forward and must run with the root unsharded (on one GPU it
  raised "aten.embedding.default got mixed torch.Tensor and DTensor").
- DeepSpeed and FSDP2's device mesh initialise NCCL alone on one GPU, which takes no CPU tensors: the
  global token count is reduced on the CUDA device ("No backend type associated with device type cpu").
"""

from __future__ import annotations

import socket
import warnings

import pytest
import torch
import torch.distributed as dist
from transformers import AutoProcessor
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

from data_pipelines.collate import collate_sequences, encode_prompt, model_inputs
from data_pipelines.synthetic import make_prompt_records
from vlrft.algorithms.aggregation import _collective_device
from vlrft.models.loading import load_model, load_processor
from vlrft.rollout import SamplingParams, make_engine
from vlrft.strategies import OptimConfig, StrategyConfig
from vlrft.strategies.fsdp2 import FSDP2Strategy


def test_image_only_processor_loads_without_the_auto_registration(tiny_model, monkeypatch):
    path = tiny_model("qwen2_5_vl")
    kept = {k: v for k, v in PROCESSOR_MAPPING._extra_content.items() if not v.__name__.startswith("ImageOnly")}
    monkeypatch.setattr(PROCESSOR_MAPPING, "_extra_content", kept)
    # what transformers 5.17 did with such a folder: the tokenizer alone, no image processor
    assert getattr(AutoProcessor.from_pretrained(path), "image_processor", None) is None
    proc = load_processor(path)
    assert type(proc).__name__ == "ImageOnlyQwen2_5_VLProcessor"
    assert proc.image_processor is not None
    assert type(load_model(path)[1]).__name__ == "ImageOnlyQwen2_5_VLProcessor"


@pytest.fixture
def world_of_one(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp2_on_one_process_embeds_once_and_generates_as_the_plain_model(tiny_model, world_of_one):
    path = tiny_model("qwen2_5_vl")
    plain, proc = load_model(path)
    strategy = FSDP2Strategy(StrategyConfig(name="fsdp2"), OptimConfig())
    strategy.prepare(load_model(path)[0])
    engine = make_engine("hf", strategy.unwrap(), proc, synced=strategy.shards_parameters)
    assert engine.prefill_once  # one process: nothing sharded, no lockstep
    prompts = [encode_prompt(proc, rec) for rec in make_prompt_records("color", 2, seed=0)]
    sampling = SamplingParams(n=2, temperature=0, max_new_tokens=4)
    got = engine.generate(prompts, sampling)
    ref = make_engine("hf", plain.eval(), proc).generate(prompts, sampling)
    assert [r.response_ids.tolist() for r in got] == [r.response_ids.tolist() for r in ref]


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):  # ModelOutput too
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def test_fsdp2_does_not_warn_about_the_outputs_views(tiny_model, world_of_one):
    # torch 2.13 warns when an FSDP2 root returns a view; a Qwen-VL's output carries its image features split
    # per image (views: image_outputs.pooler_output) beside the logits. vlrft reads outputs out of place only
    # (strategies/fsdp2.py), so the warning is not shown; the gradient equals the plain model's
    path = tiny_model("qwen2_5_vl")
    plain, proc = load_model(path)
    strategy = FSDP2Strategy(StrategyConfig(name="fsdp2"), OptimConfig())
    strategy.prepare(load_model(path)[0])
    model = strategy.unwrap()
    rec = make_prompt_records("color", 1, seed=0)[0]
    inputs = model_inputs(collate_sequences([encode_prompt(proc, rec)], [0], [torch.tensor([11, 12, 13])], 0))
    with warnings.catch_warnings(record=True) as seen:
        out = model(**inputs, logits_to_keep=4)  # as the update calls it (group_forward.py)
        assert any(t._base is not None for t in _tensors(out))  # torch's warning would be raised here
        out.logits.logsumexp(-1).sum().backward()
    assert [str(w.message) for w in seen if "view tensor" in str(w.message)] == []
    plain(**inputs, logits_to_keep=4).logits.logsumexp(-1).sum().backward()
    name, ref = next((n, p) for n, p in plain.named_parameters() if "q_proj.weight" in n)
    got = dict(model.named_parameters())[name].grad
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    # one process: FSDP2 computes the same float32 products in the same order
    assert torch.equal(got, ref.grad)


@pytest.mark.parametrize(
    "backend, cuda, expected",
    [("nccl", True, "cuda"), ("cuda:nccl", True, "cuda"), ("gloo", True, None), ("nccl", False, None)],
)
def test_token_counts_go_to_cuda_for_an_nccl_only_backend(backend, cuda, expected):
    device = _collective_device(backend, cuda)
    assert (device.type if device is not None else None) == expected


def _saved_tensors_in_forward(model) -> int:
    packed = []

    def pack(t):
        packed.append(1)
        return t

    ids = torch.randint(0, 900, (2, 12))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return len(packed)


def test_gradient_checkpointing_is_on_in_the_update(tiny_model):
    from vlrft.strategies.single import SingleStrategy

    counts = {}
    for checkpointing in (False, True):
        model, _ = load_model(tiny_model("qwen2_5_vl"))  # from_pretrained: eval mode
        strategy = SingleStrategy(StrategyConfig(gradient_checkpointing=checkpointing), OptimConfig())
        model = strategy.prepare(model)[0]
        assert model.training
        counts[checkpointing] = _saved_tensors_in_forward(model)
    assert counts[True] < counts[False] / 2, counts  # activations are recomputed, not kept
