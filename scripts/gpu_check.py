"""GPU check: a few ``train-policy`` steps of a randomly initialised Qwen2.5-VL of realistic shape on one GPU.

Builds the model from config (random weights; ``--shape 3b`` / ``7b`` follow Qwen2.5-VL-3B/7B's published
sizes, ``tiny`` is a CPU smoke), writes it with the tiny-model tokenizer and an image-only processor whose
pixel bounds give ``--image-tokens`` merged image tokens per image, then calls
``vlrft.trainer.run.train_policy`` on synthetic image prompts and prints one JSON object with per-phase
times (the trainer's own ``time/*`` metrics), rollout and update tokens/s, actor MFU in the update, peak
GPU memory per phase and the decode roofline beside the measured decode rate.

The tokenizer is the tiny model's (about 1k tokens); the embedding and LM head are padded to the real
vocabulary (151,936 / 152,064 rows), so parameter counts, LM-head FLOPs and logits memory are those of the
real models. Random weights never emit EOS, so every response is ``--max-new-tokens`` long.

One configuration per process. FSDP2 and DeepSpeed initialise torch.distributed, so launch with torchrun::

    python scripts/gpu_check.py --shape 3b --model-dir /tmp/m3b --build-only
    torchrun --nproc_per_node=1 scripts/gpu_check.py --shape 3b --model-dir /tmp/m3b \\
        --strategy fsdp2 --gradient-checkpointing --json results.jsonl
    torchrun --nproc_per_node=1 scripts/gpu_check.py --shape 3b --model-dir /tmp/m3b \\
        --strategy deepspeed --gradient-checkpointing --json results.jsonl

``--profile-step K`` runs step K's rollout and update under ``torch.profiler`` and writes, in that step's
``profile``, what bounds each: the kernels' busy time against the wall time, the kernel launches and the top
kernels and CPU operators (its times then include the profiler's overhead; profile the last of ``--steps``).

``--census-step K`` counts the operators of step K's ``--profile-phases`` where they reach their kernels (views left
out; ``gpu_figures.OpCensus``): on a GPU each is a kernel launch with its host work, which is what bounds an update
the device waits on, and a CPU counts the same operators. ``--shape 3b-narrow`` (3B's depth, heads, vision windows and
full-attention blocks at small widths) gives a 3B step's count on a CPU::

    python scripts/gpu_check.py --shape 3b-narrow --model-dir /tmp/m3bn --build-only
    torchrun --nproc_per_node=1 scripts/gpu_check.py --shape 3b-narrow --model-dir /tmp/m3bn --strategy fsdp2 \
        --mixed-precision no --inference-copy on --micro-batch-tokens 16384 --micro-train-batch 16 \
        --max-new-tokens 32 --steps 2 --census-step 2 --profile-phases update --json-dir /tmp/census

Checkpoints and the final export are skipped unless ``--save`` (they measure the disk, not the GPU, and a
3B checkpoint with fp32 AdamW state is about 45 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from gpu_figures import (  # noqa: E402
    CudagraphSkips,
    OpCensus,
    copy_bandwidth,
    experience_work,
    param_counts,
    peak_tflops,
    profile_summary,
    profiler_activities,
    rollout_flops,
    update_flops,
)

# Qwen2.5-VL-3B / 7B (config.json of the published checkpoints); the vision tower is the same for both.
VISION = dict(vision_depth=32, vision_hidden=1280, vision_heads=16, vision_intermediate=3420)
SHAPES = {
    "tiny": dict(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=128,
        vision_depth=2,
        vision_hidden=64,
        vision_heads=4,
        vision_intermediate=128,
        vocab=None,
        tie=False,
    ),
    "3b": dict(hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008, vocab=151936, tie=True, **VISION),
    "7b": dict(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152064, tie=False, **VISION),
}
# 3B's depth, heads, vision windows and full-attention blocks at a CPU's widths: the operators of a 3B step (its GPU
# kernel launches, --census-step) counted on a CPU
SHAPES["3b-narrow"] = dict(
    SHAPES["3b"], hidden=256, intermediate=512, vocab=None, vision_hidden=256, vision_intermediate=512
)


# ----------------------------------------------------------------------------------------------- model
def build_config(shape: str):
    from vlrft.models.tiny import TinySpec, build_tokenizer
    from vlrft.models.tiny import build_config as tiny_config

    s = SHAPES[shape]
    spec = TinySpec(
        arch="qwen2_5_vl",
        hidden=s["hidden"],
        layers=s["layers"],
        heads=s["heads"],
        kv_heads=s["kv_heads"],
        vision_depth=s["vision_depth"],
        vision_hidden=s["vision_hidden"],
    )
    tokenizer = build_tokenizer(spec.vocab_size)
    config = tiny_config(spec, tokenizer)
    text, vision = config.get_text_config(), config.vision_config
    text.intermediate_size = s["intermediate"]
    vision.intermediate_size = s["vision_intermediate"]
    vision.num_heads = s["vision_heads"]
    if shape in ("3b", "7b"):  # the published models' rope split (it needs their head size)
        text.max_position_embeddings = 32768
        text.rope_parameters["mrope_section"] = [16, 24, 24]
    if shape != "tiny":  # the published models' vision windows and full-attention blocks
        vision.window_size = 112
        vision.fullatt_block_indexes = [7, 15, 23, 31]
    if s["vocab"]:
        text.vocab_size = s["vocab"]
        if hasattr(config, "vocab_size"):
            config.vocab_size = s["vocab"]
    text.tie_word_embeddings = s["tie"]
    config.tie_word_embeddings = s["tie"]
    return config, tokenizer


def set_image_tokens(processor, tokens: int) -> None:
    """Pixel bounds so that every image becomes about ``tokens`` merged LLM tokens."""
    ip = processor.image_processor
    area = tokens * (ip.patch_size * ip.merge_size) ** 2
    ip.size = {"shortest_edge": area, "longest_edge": area}
    for name in ("min_pixels", "max_pixels"):
        if hasattr(ip, name):
            setattr(ip, name, area)


def build_model(shape: str, out: Path, image_tokens: int, reward_model: bool) -> None:
    """Write a random Qwen2.5-VL of ``shape`` (bf16 weights, built on the GPU when there is one)."""
    from transformers import AutoModelForImageTextToText

    from vlrft.models.processing import ImageOnlyQwen2_5_VLProcessor
    from vlrft.models.tiny import CHAT_TEMPLATE, build_image_processor

    config, tokenizer = build_config(shape)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if shape != "tiny" else torch.float32
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    text = config.get_text_config()
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = text.eos_token_id
    model.generation_config.pad_token_id = text.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    del model
    processor = ImageOnlyQwen2_5_VLProcessor(
        build_image_processor("qwen2_5_vl"), tokenizer, chat_template=CHAT_TEMPLATE
    )
    set_image_tokens(processor, image_tokens)
    processor.save_pretrained(out)
    if reward_model:
        from reward_models.scalar import ScalarRewardModel

        rm = ScalarRewardModel.from_backbone(out, dtype=dtype)
        rm.save_pretrained(out / "reward_model", processor=processor)
        del rm
    print(f"[gpu_check] wrote {shape} model to {out} in {time.perf_counter() - t0:.1f}s", flush=True)


# ----------------------------------------------------------------------------------------------- probes
class Probe:
    """Per-phase timing and peak GPU memory, by wrapping trainer methods (reset the peak before each)."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.steps: list[dict] = []
        self.metrics: list[dict] = []  # the trainer's metrics of each step (time/step measured around it)
        self.current: dict = {}
        self.on_step = None  # called after each step
        self.profile_step = 0  # the step (from 1) whose profile_phases run under torch.profiler (0: none)
        self.profile_phases: tuple[str, ...] = ()
        self.census_step = 0  # the step (from 1) whose profile_phases' operators are counted (0: none)
        self.census_where: tuple[str, ...] = ()  # operators whose call sites the census counts
        self.counts_cudagraphs = False  # whether this torch has the method the CUDA graph count wraps
        self.cudagraph_skips: CudagraphSkips | None = None

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def wrap(self, owner, name: str, phase: str, after=None):
        original = getattr(owner, name)
        probe = self

        def wrapped(*args, **kwargs):
            probe.sync()
            if probe.cuda:
                torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() if probe.cuda else 0
            profiling = phase in probe.profile_phases and len(probe.steps) + 1 == probe.profile_step
            counting = phase in probe.profile_phases and len(probe.steps) + 1 == probe.census_step
            census = OpCensus(probe.census_where) if counting else nullcontext()
            with torch.profiler.profile(activities=profiler_activities()) if profiling else nullcontext() as prof:
                with census:
                    t0 = time.perf_counter()
                    result = original(*args, **kwargs)
                    probe.sync()
                    elapsed = time.perf_counter() - t0
            rec = probe.current.setdefault(phase, {"s": 0.0, "peak_gib": 0.0, "calls": 0})
            rec["s"] += elapsed
            rec["calls"] += 1
            if profiling:
                rec.setdefault("profile", []).append(profile_summary(prof.key_averages(), elapsed))
            if counting:
                rec.setdefault("census", []).append(census.summary())
            if probe.cuda:
                rec["peak_gib"] = max(rec["peak_gib"], torch.cuda.max_memory_allocated() / 2**30)
                rec["allocated_before_gib"] = before / 2**30
                rec["allocated_after_gib"] = torch.cuda.memory_allocated() / 2**30
            if after is not None:
                after(rec, args, kwargs, result)
            return result

        setattr(owner, name, wrapped)

    def install(self, save: bool) -> None:
        from reward_models.pool import RewardPool
        from vlrft.rollout.hf_engine import HFRolloutEngine
        from vlrft.rollout.inference_copy import InferenceCopyEngine
        from vlrft.strategies.base import Strategy
        from vlrft.trainer.policy_trainer import PolicyTrainer

        probe = self

        # decode timing: a forward hook on the generating module stamps every forward of generate
        original_generate = HFRolloutEngine.generate

        def generate(engine, prompts, sampling):
            stamps: list[tuple[float, int, int]] = []

            # kept out of torch.compile: traced, its sync and clock broke the compiled decode's graph and recompiled
            # until dynamo's limit (seen on an H200)
            @torch.compiler.disable
            def hook(module, args, kwargs, output):
                probe.sync()
                ids = kwargs.get("input_ids")
                emb = kwargs.get("inputs_embeds")
                x = ids if ids is not None else emb
                stamps.append((time.perf_counter(), int(x.shape[0]), int(x.shape[1])))

            handle = engine.model.register_forward_hook(hook, with_kwargs=True)
            try:
                t0 = time.perf_counter()
                out = original_generate(engine, prompts, sampling)
            finally:
                handle.remove()
            rec = probe.current.setdefault(
                "generate_detail",
                {"forwards": 0, "decode_s": 0.0, "decode_steps": 0, "decode_rows": 0, "prefill_s": 0.0},
            )
            if stamps:
                rec["prefill_s"] += stamps[0][0] - t0
                rec["forwards"] += len(stamps)
                rec["decode_steps"] += len(stamps) - 1
                rec["decode_s"] += stamps[-1][0] - stamps[0][0]
                # the decode steps' rows (the prefill runs once per prompt: fewer rows than the n samples decoded)
                rec["decode_rows"] = max(rec["decode_rows"], stamps[-1][1])
                rec["prefill_len"] = stamps[0][2]
            rec["generated_tokens"] = rec.get("generated_tokens", 0) + sum(len(r.response_ids) for r in out)
            return out

        HFRolloutEngine.generate = generate
        self.wrap(HFRolloutEngine, "generate", "rollout")
        self.wrap(RewardPool, "score", "reward")
        self.wrap(PolicyTrainer, "_logprobs", "logprobs")

        # the micro-batches the update runs (recorded as the trainer forms them) and whether it packs groups
        import vlrft.trainer.policy_trainer as policy_module

        original_parts = policy_module.sequence_micro_batches

        def parts_recorded(*args, packed: bool, **kwargs):
            parts = original_parts(*args, packed=packed, **kwargs)
            rec = probe.current.setdefault("micro_batches", {"parts": [], "packed": packed})
            rec["parts"] += [idx.tolist() for idx, weight in parts if weight]
            return parts

        policy_module.sequence_micro_batches = parts_recorded

        def after_update(rec, args, kwargs, result):
            trainer, exp = args[0], args[1]
            # the work as the update computes it: the group-shared forward computes each prompt once per group within
            # a micro-batch (micro-batches of one sample compute it for every sample)
            mbs = probe.current.pop("micro_batches", {"parts": None, "packed": trainer.shared})
            update, rollout = experience_work(exp, shared=mbs["packed"], micro_batches=mbs["parts"])
            rec["micro_batches"] = len(mbs["parts"]) if mbs["parts"] is not None else None
            rec.update(update)
            rec["rollout_work"] = rollout
            rec["samples"] = len(exp)
            rec["response_tokens"] = int(exp.response_mask.sum())

        self.wrap(PolicyTrainer, "train_on", "update", after=after_update)
        self.wrap(PolicyTrainer, "_sync_engine", "weight_sync")
        # the engine's sleep (before the update, outside the trainer's phases) and wake (the start of weight_sync),
        # on the module or on its inference copy (each class's own methods: neither calls the other's)
        for engine_class in (HFRolloutEngine, InferenceCopyEngine):
            self.wrap(engine_class, "sleep", "engine_sleep")
            self.wrap(engine_class, "wake", "engine_wake")

        # CUDA graphs recorded (torch.compile's cudagraph trees, a private API: counted where it exists): a recording
        # after the first step means the decode step's graph is recorded again, e.g. because its weights or its KV
        # cache moved to new addresses (rollout.hf.sleep_level 1 and 2 give the copy's weights new memory each wake)
        try:
            from torch._inductor.cudagraph_trees import CUDAGraphTreeManager
        except ImportError:
            CUDAGraphTreeManager = None
        if hasattr(CUDAGraphTreeManager, "record_function"):
            original_record = CUDAGraphTreeManager.record_function

            def record_function(manager, *args, **kwargs):
                rec = probe.current.setdefault("cudagraphs", {"recorded": 0})
                rec["recorded"] += 1
                return original_record(manager, *args, **kwargs)

            CUDAGraphTreeManager.record_function = record_function
            self.counts_cudagraphs = True

        # a step ends when the trainer returns its metrics: file the step's records (and write the JSON so far)
        original_step = PolicyTrainer.step

        def step(trainer, i):
            t0 = time.perf_counter()
            metrics = original_step(trainer, i)
            probe.steps.append(probe.current)
            probe.metrics.append({**metrics, "time/step": time.perf_counter() - t0})
            probe.current = {}
            if probe.on_step is not None:
                probe.on_step()
            return metrics

        PolicyTrainer.step = step

        if not save:
            from vlrft.loop import Run

            # the run's checkpoints (a 3B one with fp32 AdamW state is about 45 GB: it filled an H200 machine's disk)
            Run._save = lambda run, trainer, step, history: None
            Strategy.save_pretrained = lambda strategy, out_dir, processor=None: None


# ----------------------------------------------------------------------------------------------- figures
def summarise(args, config, counts, bw: float, peak: float, probe: Probe, metrics: list[dict]) -> dict:
    from torch._dynamo.utils import counters

    text = config.get_text_config()
    kv_bytes_per_token = (
        2 * text.num_hidden_layers * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads) * 2
    )
    weight_bytes = 2 * (counts["decoder"] + (counts["lm_head"] or counts["embed"]) + counts["other"])
    steps = []
    for i, (m, ph) in enumerate(zip(metrics, probe.steps)):
        upd = ph.get("update", {})
        gen = ph.get("generate_detail", {})
        flops = update_flops(config, counts, upd) if upd else {}
        roll = rollout_flops(config, counts, upd["rollout_work"]) if upd else {}
        t_update = m.get("time/update", float("nan"))
        t_rollout = m.get("time/rollout", float("nan"))
        rows, dsteps, dsec = gen.get("decode_rows", 0), gen.get("decode_steps", 0), gen.get("decode_s", 0.0)
        ctx = gen.get("prefill_len", 0) + dsteps / 2  # mean context over the decode
        roof_step = (weight_bytes + rows * ctx * kv_bytes_per_token) / bw if bw == bw else float("nan")
        measured_step = dsec / dsteps if dsteps else float("nan")
        steps.append(
            {
                "step": i + 1,
                "time_s": {k.removeprefix("time/"): round(v, 3) for k, v in m.items() if k.startswith("time/")},
                "engine_s": {k: round(ph[f"engine_{k}"]["s"], 3) for k in ("sleep", "wake") if f"engine_{k}" in ph},
                "rollout_tokens_per_s": round(gen.get("generated_tokens", 0) / m["time/rollout"], 1)
                if m.get("time/rollout")
                else None,
                "update_response_tokens_per_s": round(m.get("tokens_per_s/update", float("nan")), 1),
                "update_computed_tokens_per_s": round(upd.get("seq_tokens", 0) / t_update, 1),
                "update_tflops_per_s": round(flops.get("total", 0) / t_update / 1e12, 1),
                "actor_mfu": round(flops.get("total", 0) / t_update / (peak * 1e12), 4) if peak == peak else None,
                "update_flops_split": {k: f"{v:.3e}" for k, v in flops.items()},
                "rollout_tflops_per_s": round(roll.get("total", 0) / t_rollout / 1e12, 2),
                "rollout_mfu": round(roll.get("total", 0) / t_rollout / (peak * 1e12), 4) if peak == peak else None,
                "rollout_flops_split": {k: f"{v:.3e}" for k, v in roll.items()},
                "profile": {k: v["profile"] for k, v in ph.items() if "profile" in v},
                "census": {k: v["census"] for k, v in ph.items() if "census" in v},
                "cudagraphs_recorded": ph.get("cudagraphs", {}).get("recorded", 0) if probe.counts_cudagraphs else None,
                "peak_gib": {k: round(v["peak_gib"], 2) for k, v in ph.items() if "peak_gib" in v},
                "allocated_after_gib": {
                    k: round(v["allocated_after_gib"], 2) for k, v in ph.items() if "allocated_after_gib" in v
                },
                "decode": {
                    "rows": rows,
                    "prefill_tokens_per_row": gen.get("prefill_len"),
                    "prefill_s": round(gen.get("prefill_s", 0.0), 3),
                    "steps": dsteps,
                    "measured_ms_per_step": round(1e3 * measured_step, 2),
                    "measured_tokens_per_s": round(rows / measured_step, 1) if dsteps else None,
                    "roofline_ms_per_step": round(1e3 * roof_step, 2),
                    "roofline_tokens_per_s": round(rows / roof_step, 1) if roof_step == roof_step else None,
                    "measured_over_roofline_time": round(measured_step / roof_step, 2) if dsteps else None,
                },
                "samples": upd.get("samples"),
                "update_micro_batches": upd.get("micro_batches"),
                "update_seq_tokens": upd.get("seq_tokens"),
                "update_response_tokens": upd.get("response_tokens"),
                "image_patches": upd.get("image_patches"),
            }
        )
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    import transformers

    return {
        "config": {
            "shape": args.shape,
            "strategy": args.strategy + (f"-zero{args.zero_stage}" if args.strategy == "deepspeed" else ""),
            "gradient_checkpointing": args.gradient_checkpointing,
            "compile_blocks": args.compile_blocks,
            "cpu_offload": args.cpu_offload,
            "param_dtype": args.model_dtype,
            "mixed_precision": args.mixed_precision,
            "inference_copy": args.inference_copy,
            "compile": args.compile,
            "micro_batch_tokens": args.micro_batch_tokens,
            "sleep_level": args.sleep_level,
            "profile_step": args.profile_step,  # that step's times include the profiler's overhead
            "reward_model": args.reward_model,
            "prompts": args.prompts,
            "samples_per_prompt": args.samples,
            "max_new_tokens": args.max_new_tokens,
            "image_tokens": args.image_tokens,
            "micro_train_batch_size": args.micro_train_batch,
            "memory_cap_gib": args.memory_cap_gib or None,  # the allocator's cap (None: the whole device)
        },
        "device": gpu,
        "dist_backend": str(torch.distributed.get_backend()) if torch.distributed.is_initialized() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "params": counts,
        "weight_bytes_per_decode_step_bf16": weight_bytes,
        "copy_bandwidth_TBps": round(bw / 1e12, 3) if bw == bw else None,
        "peak_bf16_tflops": peak,
        "max_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if torch.cuda.is_available()
        else None,
        # torch.compile's own record (cumulative): graph breaks, recompilations, CUDA graph skips (``inductor``:
        # ``cudagraph_skips``): whether the compiled decode ran as captured graphs; empty where nothing compiled
        "compile_counters": {k: {str(n): c for n, c in v.items()} for k, v in counters.items() if v},
        # why: torch's "skipping cudagraphs due to ..." messages by their first line, with their counts
        "cudagraph_skip_reasons": dict(probe.cudagraph_skips.reasons) if probe.cudagraph_skips else None,
        "steps": steps,
    }


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="tiny")
    p.add_argument("--model-dir", type=Path, required=True, help="built here when it holds no config.json")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--out-dir", type=Path, default=Path("runs/gpu_check"))
    p.add_argument("--json", type=Path, help="append the summary (one line) to this file")
    p.add_argument("--strategy", choices=("fsdp2", "deepspeed", "single"), default="fsdp2")
    p.add_argument("--zero-stage", type=int, default=3)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--compile-blocks", action="store_true", help="strategy.compile_blocks (torch.compile per block)")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument(
        "--model-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="parameter (and AdamW state) dtype; compute is bf16 either way",
    )
    p.add_argument("--mixed-precision", choices=("auto", "bf16", "no"), default="bf16", help="strategy.mixed_precision")
    p.add_argument("--inference-copy", choices=("auto", "on", "off"), default="auto", help="rollout.hf.inference_copy")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="rollout.hf.compile")
    p.add_argument("--micro-batch-tokens", type=int, default=0, help="train.micro_batch_tokens (0: by sample count)")
    p.add_argument("--sleep-level", type=int, default=1, choices=(0, 1, 2), help="rollout.hf.sleep_level")
    p.add_argument("--json-dir", type=Path, help="write NAME.json here after every step (a cut run keeps its steps)")
    p.add_argument("--name", default="", help="this configuration's name (default: from its options)")
    p.add_argument("--reward-model", action="store_true", help="a scalar RM of the same shape in the pool")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--image-tokens", type=int, default=1024)
    p.add_argument("--micro-train-batch", type=int, default=4)
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device bf16 dense peak (default: by name)")
    p.add_argument(
        "--memory-cap-gib",
        type=float,
        default=0.0,
        help="cap PyTorch's CUDA allocator at this many GiB (torch.cuda.set_per_process_memory_fraction), so that a "
        "larger GPU runs as a smaller one would: 79.2 for an 80 GB H100 (0: no cap)",
    )
    p.add_argument("--save", action="store_true", help="keep the end-of-run checkpoint and final export")
    p.add_argument(
        "--profile-step",
        type=int,
        default=0,
        help="run this step's --profile-phases under torch.profiler (its times are then the profiler's, not the "
        "plain run's) and write what bounds them in its JSON (profile: device busy fraction, top kernels, CPU ops)",
    )
    p.add_argument("--profile-phases", default="rollout,update", help="comma-separated phases to profile")
    p.add_argument(
        "--census-step",
        type=int,
        default=0,
        help="count the operators (GPU kernel launches) of this step's --profile-phases, views left out, into its "
        "JSON (census: ops, top_ops); the count is the same on a CPU, so the 3b-narrow shape measures a 3B step's "
        "launches without a GPU (its times are then not figures)",
    )
    p.add_argument("--census-where", default="", help="comma-separated operators whose call sites the census counts")
    p.add_argument("overrides", nargs="*", help="extra train-policy key=value overrides")
    args = p.parse_args(argv)

    if not (args.model_dir / "config.json").is_file() or (
        args.reward_model and not (args.model_dir / "reward_model").is_dir()
    ):
        if int(os.environ.get("RANK", "0")) == 0:
            build_model(args.shape, args.model_dir, args.image_tokens, args.reward_model)
    if args.build_only:
        return None

    import vlrft.models  # noqa: F401  (registers the image-only processors)
    from vlrft.config import load_config
    from vlrft.trainer.config import PolicyTrainConfig
    from vlrft.trainer.run import train_policy

    config, _ = build_config(args.shape)
    counts = param_counts(config)
    if args.memory_cap_gib and torch.cuda.is_available():
        # before anything is allocated: the whole run, its caching allocator's fragmentation included, must fit the
        # cap (the CUDA context and libraries' own workspaces outside PyTorch's allocator are not counted)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        total = torch.cuda.get_device_properties(local).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total), local)
    bw = copy_bandwidth()
    peak = peak_tflops(args.peak_tflops)
    side = 28 * int(round(args.image_tokens**0.5))
    reward = "[{name: accuracy, kind: verifier, verifier: vocab_answer}"
    if args.reward_model:
        reward += f", {{name: rm, kind: srm, path: '{args.model_dir / 'reward_model'}', weight: 0.0}}"
    reward += "]"
    overrides = [
        f"model.path={args.model_dir}",
        f"model.dtype={args.model_dtype}",
        "data.train_source=synthetic:color",
        "data.eval_source=''",
        f"data.synthetic_train_size={max(16, args.prompts * args.steps)}",
        f"data.synthetic_options={{image_size: {side}}}",
        f"data.max_prompt_length={args.image_tokens + 512}",
        f"rollout.rollout_batch_size={args.prompts}",
        f"rollout.n_samples_per_prompt={args.samples}",
        f"rollout.micro_rollout_batch_size={args.prompts}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.temperature=1.0",
        "algorithm.kl_coef=0",
        "algorithm.loss_agg_mode=token-mean",
        f"reward.sources={reward}",
        f"train.max_steps={args.steps}",
        f"train.micro_train_batch_size={args.micro_train_batch}",
        f"train.output_dir={args.out_dir}",
        "train.log_samples=1",
        "train.resume=never",
        "train.overwrite=true",  # the run folder is this script's scratch (a cut run's leftovers are cleared)
        f"strategy.name={args.strategy}",
        f"strategy.zero_stage={args.zero_stage}",
        f"strategy.mixed_precision={args.mixed_precision}",
        f"rollout.hf.inference_copy={args.inference_copy}",
        f"rollout.hf.compile={args.compile}",
        f"rollout.hf.sleep_level={args.sleep_level}",
        f"train.micro_batch_tokens={args.micro_batch_tokens}",
        f"strategy.gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
        f"strategy.compile_blocks={str(args.compile_blocks).lower()}",
        f"strategy.cpu_offload={str(args.cpu_offload).lower()}",
        "optim.lr=1e-6",
        "logging.tensorboard=false",
        "logging.wandb=disabled",
        "logging.progress_bar=false",
        *args.overrides,
    ]
    cfg = load_config(PolicyTrainConfig, None, overrides)
    if args.compile != "off" and torch.cuda.is_available():
        # the reasons behind the counters, in the run's log: why a graph broke or recompiled, why CUDA graphs were
        # skipped (torch's artifact logs, off by default)
        torch._logging.set_logs(graph_breaks=True, recompiles=True, perf_hints=True)
    probe = Probe()
    probe.cudagraph_skips = CudagraphSkips.attach()  # the reasons behind ``cudagraph_skips``, into the JSON
    probe.profile_step, probe.profile_phases = args.profile_step, tuple(filter(None, args.profile_phases.split(",")))
    probe.census_step, probe.census_where = args.census_step, tuple(filter(None, args.census_where.split(",")))
    probe.install(save=args.save)
    name = args.name or config_name(args)
    t0 = time.perf_counter()

    def write(final: bool = False) -> dict:
        result = summarise(args, config, counts, bw, peak, probe, probe.metrics)
        result["name"], result["complete"] = name, final
        result["train_policy_wall_s"] = round(time.perf_counter() - t0, 1)
        if int(os.environ.get("RANK", "0")) == 0 and args.json_dir:
            args.json_dir.mkdir(parents=True, exist_ok=True)
            tmp = args.json_dir / f"{name}.json.tmp"
            tmp.write_text(json.dumps(result, indent=1))
            tmp.replace(args.json_dir / f"{name}.json")
        return result

    probe.on_step = write
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    train_policy(cfg)
    result = write(final=True)
    if int(os.environ.get("RANK", "0")) == 0:
        print("[gpu_check] " + json.dumps(result, indent=1), flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            with args.json.open("a") as f:
                f.write(json.dumps(result) + "\n")
    return result


def config_name(args) -> str:
    """A file name for a configuration: shape, strategy and the options of issue 27's items."""
    parts = [args.shape, args.strategy, f"mp-{args.mixed_precision}", f"copy-{args.inference_copy}"]
    parts += [f"compile-{args.compile}", f"tokens-{args.micro_batch_tokens}", f"micro-{args.micro_train_batch}"]
    parts += ["ckpt"] * args.gradient_checkpointing + ["blocks"] * args.compile_blocks + [args.model_dtype]
    return "_".join(parts)


if __name__ == "__main__":
    main()
    from vlrft.strategies import finish_process  # one rank of several ends here (its docstring says why)

    sys.exit(finish_process(0))
