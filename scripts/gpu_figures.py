"""Figures of scripts/gpu_check.py: parameter counts by part, device copy bandwidth, the peak bf16 rate of
the GPU at hand, and the model FLOPs of one update (the numerator of actor MFU)."""

from __future__ import annotations

import functools
import logging
import os
import time
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForImageTextToText

# dense bf16 peak of the SXM parts (TFLOP/s); PCIe cards are not listed (their peak is lower)
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0}


def param_counts(config) -> dict[str, int]:
    """Parameters by part, counted on the meta device (no memory)."""
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    parts = {"decoder": 0, "embed": 0, "lm_head": 0, "vision": 0, "other": 0}
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        if ".layers." in name:
            parts["decoder"] += p.numel()
        elif "embed_tokens" in name:
            parts["embed"] += p.numel()
        elif "lm_head" in name:
            parts["lm_head"] += p.numel()
        elif "visual" in name:
            parts["vision"] += p.numel()
        else:
            parts["other"] += p.numel()
    parts["tied"] = int(bool(config.get_text_config().tie_word_embeddings))
    parts["total"] = sum(v for k, v in parts.items() if k != "tied")
    return parts


def decode_gemm_flops_per_s(
    config, rows: int, threads: int, dtype: torch.dtype = torch.float32, seconds: float = 1.0, onednn: bool = False
) -> float:
    """This machine's rate (in ``dtype``) for the matrix products of one decode step of ``config``'s model: every linear
    layer of the text decoder and the LM head (random weights of their shapes, each its own tensor, applied in
    layer order as decoding does, so that they are read from memory unless all of them fit in cache) on ``rows``
    rows (the samples decoding together), repeated for about ``seconds``, the best of three rounds. At a few dozen
    rows each weight is read once per step for little arithmetic, so this is the ceiling of the rollout's products,
    below the square-matmul rate of :func:`gemm_flops_per_s` once the weights outgrow the caches. ``onednn``: the
    products by oneDNN, as ``strategy.cpu_matmul=onednn`` computes them (float32 on a CPU), else by ``F.linear``."""
    linear = _onednn_linear() if onednn else torch.nn.functional.linear
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    shapes = [
        (m.out_features, m.in_features, m.bias is not None)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and "visual" not in name
    ]
    layers = [((torch.randn(o, i) * 0.02).to(dtype), torch.zeros(o, dtype=dtype) if b else None) for o, i, b in shapes]
    inputs = {i: torch.randn(rows, i).to(dtype) for _, i, _ in shapes}

    def step() -> None:
        for w, b in layers:
            linear(inputs[w.shape[1]], w, b)

    return _best_rate(step, sum(2 * rows * o * i for o, i, _ in shapes), threads, seconds)


def _onednn_linear():
    from vlrft.models.cpu_matmul import onednn_linear  # the scripts also run where only the GPU figures are wanted

    return onednn_linear


def copy_bandwidth(gib: float = 4.0, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    if not torch.cuda.is_available():
        return float("nan")
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 * iters / dt


def peak_tflops(override: float) -> float:
    if override:
        return override
    if not torch.cuda.is_available():
        return float("nan")
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name and "PCIe" not in name:
            return value
    return float("nan")


def vision_attention_pairs(config, grids) -> float:
    """Query-key pairs of the vision tower's attention over images of ``grids`` ([t, h, w] each), summed over its
    blocks: full-attention blocks over every image's patches, windowed blocks within windows."""
    vision = config.vision_config
    depth = vision.depth
    full_blocks = len(getattr(vision, "fullatt_block_indexes", []) or [])
    win = (getattr(vision, "window_size", 112) // vision.patch_size) ** 2
    pairs = 0.0
    for t, h, w in grids:
        p = t * h * w
        pairs += full_blocks * p * p + (depth - full_blocks) * p * min(p, win)
    return pairs


def update_flops(config, counts: dict, upd: dict) -> dict[str, float]:
    """Model FLOPs of one update (forward + backward, no recompute): 6 x params x tokens for the decoder,
    the vision tower (per patch) and the LM head (per logit row computed), plus attention (12 x head width per
    query-key pair and layer: ``upd["attention_pairs"]``, or causal rows of ``upd["seq_lengths"]``)."""
    text, vision = config.get_text_config(), config.vision_config
    heads_dim = text.num_attention_heads * (text.hidden_size // text.num_attention_heads)
    dense = 6 * counts["decoder"] * upd["seq_tokens"]
    pairs = upd.get("attention_pairs")
    if pairs is None:
        pairs = sum(L * L for L in upd["seq_lengths"]) / 2  # causal: half of every row's L x L
    attn = 12 * text.num_hidden_layers * heads_dim * pairs
    head_params = counts["lm_head"] or counts["embed"]
    head = 6 * head_params * upd["logit_rows"]
    vis_dense = 6 * (counts["vision"]) * upd["image_patches"]
    vis_attn = 12 * vision.hidden_size * vision_attention_pairs(config, upd["image_grids"])
    return {
        "decoder": dense,
        "attention": attn,
        "lm_head": head,
        "vision": vis_dense + vis_attn,
        "total": dense + attn + head + vis_dense + vis_attn,
    }


def rollout_flops(config, counts: dict, work: dict) -> dict[str, float]:
    """Model FLOPs of one rollout (forward only: a third of :func:`update_flops`'s per token): the prefill of each
    prompt once (``work["prompt_lengths"]``, its last position's logits only), the vision tower once per prompt
    (``work["image_grids"]``), and ``work["decode_tokens"]`` decode positions (every row of a generate call for
    each of its steps, finished rows included: what the machine computes) at 2 x (decoder + LM head) parameters
    each, with attention over ``work["decode_context"]`` keys in all (4 x head width per query-key pair and layer)."""
    text, vision = config.get_text_config(), config.vision_config
    heads_dim = text.num_attention_heads * (text.hidden_size // text.num_attention_heads)
    layers = text.num_hidden_layers
    head_params = counts["lm_head"] or counts["embed"]
    prompts = work["prompt_lengths"]
    prefill = 2 * counts["decoder"] * sum(prompts) + 2 * head_params * len(prompts)
    prefill += 4 * layers * heads_dim * sum(L * L for L in prompts) / 2
    vis = 2 * counts["vision"] * sum(t * h * w for t, h, w in work["image_grids"])
    vis += 4 * vision.hidden_size * vision_attention_pairs(config, work["image_grids"])
    decode = 2 * (counts["decoder"] + head_params) * work["decode_tokens"]
    decode += 4 * layers * heads_dim * work["decode_context"]
    return {"prefill": prefill, "vision": vis, "decode": decode, "total": prefill + vis + decode}


def experience_work(
    exp, shared: bool = True, generate_width: int | None = None, micro_batches: list[list[int]] | None = None
) -> tuple[dict, dict]:
    """(update work for :func:`update_flops`, rollout work for :func:`rollout_flops`) of one step's experience
    (``vlrft.trainer.experience.Experience``) as the update computes it: with the group-shared forward (``shared``)
    each prompt and its images once per group within a micro-batch and each response after it, a response token
    attending to the prompt and its own past; without it every sample's prompt, images and response (causal); logit
    rows for the response positions only (``logits_to_keep``). ``micro_batches``: the sample indices of each
    micro-batch the update ran (all epochs; default: one holding every sample once), so a group split over
    micro-batches (micro-batches of one sample, say) computes its prompt in each. The rollout: the prefill and vision
    once per prompt, and rows decoding ``generate_width`` steps (default: the longest response) in one generate
    call."""
    b = exp.batch
    plen, rlen = b["prompt_lengths"].tolist(), b["response_lengths"].tolist()
    groups: dict[int, int] = {}
    for i, j in enumerate(b["prompt_index"].tolist()):
        groups.setdefault(j, i)
    grids = b["image_grid_thw"].tolist() if "image_grid_thw" in b else []
    per_sample = b["images_per_sample"].tolist() if "images_per_sample" in b else [0] * len(plen)
    starts = [sum(per_sample[:i]) for i in range(len(per_sample))]
    sample_grids = [grids[starts[i] : starts[i] + per_sample[i]] for i in range(len(plen))]
    prompt_grids = [g for i in groups.values() for g in sample_grids[i]]
    prompts = [plen[i] for i in groups.values()]
    index = b["prompt_index"].tolist()
    pairs = seq_tokens = 0.0
    logit_rows = 0
    update_grids = []
    for mb in micro_batches if micro_batches is not None else [list(range(len(plen)))]:
        logit_rows += sum(rlen[i] for i in mb)
        if shared:  # each prompt of the micro-batch once, then its responses
            firsts = list({index[i]: i for i in reversed(mb)}.values())
            pairs += sum(plen[i] * plen[i] / 2 for i in firsts) + sum(
                rlen[i] * plen[i] + rlen[i] * (rlen[i] + 1) / 2 for i in mb
            )
            seq_tokens += sum(plen[i] for i in firsts) + sum(rlen[i] for i in mb)
            update_grids += [g for i in firsts for g in sample_grids[i]]
        else:
            pairs += sum((plen[i] + rlen[i]) ** 2 / 2 for i in mb)
            seq_tokens += sum(plen[i] + rlen[i] for i in mb)
            update_grids += [g for i in mb for g in sample_grids[i]]
    update = {
        "seq_tokens": seq_tokens,
        "attention_pairs": pairs,
        "logit_rows": logit_rows,
        "image_patches": sum(t * h * w for t, h, w in update_grids),
        "image_grids": update_grids,
    }
    steps = generate_width or max(rlen)
    rows = len(rlen)
    rollout = {
        "prompt_lengths": prompts,
        "image_grids": prompt_grids,
        "decode_tokens": rows * steps,
        "decode_context": sum(P * steps + steps * (steps + 1) / 2 for P in plen),
    }
    return update, rollout


def gemm_flops_per_s(threads: int, n: int = 1024, seconds: float = 1.0, onednn: bool = False) -> float:
    """This machine's float32 matmul rate (FLOP/s) with ``threads`` torch threads: ``n x n`` by ``n x n``
    products repeated for about ``seconds``, the best of three rounds; by PyTorch's ``mm`` (MKL on x86), or
    ``onednn``: by oneDNN's linear kernel (``strategy.cpu_matmul``), which on some CPUs runs at twice MKL's rate."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    work = functools.partial(_onednn_linear(), a, b) if onednn else functools.partial(torch.mm, a, b)
    with torch.no_grad():
        return _best_rate(work, 2 * n**3, threads, seconds)


def _best_rate(work, flops: float, threads: int, seconds: float) -> float:
    """FLOP/s of ``work()`` (``flops`` each call) with ``threads`` torch threads: after one call, repeated for about
    ``seconds`` in three rounds, the best round."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    work()
    best = 0.0
    for _ in range(3):
        count, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            work()
            count += 1
        best = max(best, flops * count / (time.perf_counter() - t0))
    torch.set_num_threads(saved)
    return best


def profiler_activities() -> list:
    """What ``torch.profiler`` records here: CPU operators, and the device's kernels where there is a GPU."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def profile_summary(events, wall_s: float, top: int = 12) -> dict:
    """What bounds a profiled phase, from ``prof.key_averages()``: the kernels' device time against the phase's wall
    time (a decode whose device is busy a fifth of the time waits on the host, not on memory bandwidth), the kernel
    launches, and the kernels and CPU operators that take the most time. Times in seconds (the profiler's are
    microseconds); a kernel's time is its own (``self_device_time_total``), an operator's CPU time its own too."""
    cpu = torch.autograd.DeviceType.CPU
    events = [e for e in events if not getattr(e, "is_user_annotation", False)]  # not record_function ranges
    kernels = [e for e in events if e.device_type != cpu]
    ops = [e for e in events if e.device_type == cpu]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6

    def rows(evts, key) -> list[dict]:
        chosen = sorted(evts, key=key, reverse=True)[:top]
        return [{"name": e.key[:120], "calls": e.count, "s": round(key(e) / 1e6, 4)} for e in chosen if key(e) > 0]

    return {
        "wall_s": round(wall_s, 4),
        "device_busy_s": round(busy, 4),
        "device_busy_fraction": round(busy / wall_s, 4) if kernels and wall_s > 0 else None,
        "kernel_launches": sum(e.count for e in kernels),
        "cpu_self_s": round(sum(e.self_cpu_time_total for e in ops) / 1e6, 4),
        "top_kernels": rows(kernels, lambda e: e.self_device_time_total),
        "top_cpu_ops": rows(ops, lambda e: e.self_cpu_time_total),
    }


class OpCensus(TorchDispatchMode):
    """The operators a phase runs, counted where they reach their kernels (below autograd, so the backward's are
    counted too): on a GPU each is at least one kernel launch with its host work, so their number is what bounds a
    phase the device waits on (the update's device was busy 36 % of it on the H200). Views and other aliasing
    operators (``func.is_view``) and bare allocations launch nothing and are left out. A CPU run of the same model
    counts the same operators as a GPU run, apart from the device's own choices (a compiled, captured decode step
    is one graph launch there, its operators uncounted here), so a change's effect on the launches is measured
    without a GPU. The counting costs host time: a census step's times are not figures."""

    NO_KERNEL = frozenset(
        {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "_unsafe_view"}
    )

    def __init__(self, where: tuple[str, ...] = ()):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.where = frozenset(where)  # operators whose call sites are counted too
        self.sites: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in self.NO_KERNEL:
            self.counts[name] += 1
            if name in self.where:
                self.sites[f"{name} at {_call_site()}"] += 1
        return func(*args, **(kwargs or {}))

    def summary(self, top: int = 40) -> dict:
        out = {"ops": sum(self.counts.values()), "top_ops": dict(self.counts.most_common(top))}
        if self.where:
            out["sites"] = dict(self.sites.most_common(top))
        return out


def _call_site() -> str:
    """The innermost frame outside torch (the code that asked for an operator): ``file:line function``."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if f"{os.sep}torch{os.sep}" not in frame.filename and "gpu_figures" not in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return "?"


class CudagraphSkips(logging.Handler):
    """Why torch.compile ran a graph without CUDA graphs: the warnings torch logs where it bumps the ``inductor``
    counter ``cudagraph_skips``, which only counts them (its ``log_cudagraph_skip_and_bump_counter``: a CPU node,
    mutated inputs, "skipping cudagraph due to function ... exceeding max re-recording limit", ...), recognised by
    that function's name or by the words they start with. Attached to the ``torch._inductor`` logger (its children's
    records reach it); ``reasons`` counts each message by its first line. torch logs the skips of graphs on CUDA
    only (those of CPU graphs are counted silently)."""

    FUNCTION = "log_cudagraph_skip_and_bump_counter"
    STARTS = ("skipping cudagraph", "disabling cudagraph")

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reasons: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.funcName == self.FUNCTION or message.startswith(self.STARTS):
            line = message.splitlines()[0][:300]
            self.reasons[line] = self.reasons.get(line, 0) + 1

    @classmethod
    def attach(cls) -> "CudagraphSkips":
        """A handler on ``torch._inductor``'s logger (after ``torch._logging.set_logs``, which resets its handlers)."""
        handler = cls()
        logging.getLogger("torch._inductor").addHandler(handler)
        return handler
