"""Time the inference copy's weight refresh under FSDP2 or ZeRO-3: the stream gathered unit by unit (vlrft: one
all-gather per block and one for the root's parameters; FSDP2's ``unshard``, ZeRO-3's partitions as one flat buffer)
against the same stream gathered parameter by parameter (``Strategy._full_tensor``: FSDP2's ``full_tensor`` as verl's
FSDP weight sync gathers, ZeRO-3's ``GatheredParameters`` as OpenRLHF's; vlrft's before), in one run, alternating.

Both feed the hf engine's inference copy (``rollout.hf.inference_copy=on``, in ``--copy-dtype``) exactly as
``PolicyTrainer`` does after each update, from a randomly initialised Qwen2.5-VL of ``--hidden --layers --heads
--vision-depth --vision-hidden``; ``--mixed-precision bf16`` computes in bf16 (FSDP2: then only a bf16 copy is
gathered by unit). Rounds alternate between the two, the first of each uncounted; prints the median time of one refresh
for each, their ratio and the collectives each made. Run under torchrun (gloo on CPU, NCCL on GPU):

    torchrun --nproc_per_node 2 scripts/bench_weight_sync.py --hidden 512 --layers 6 --vision-depth 6 \\
        --vision-hidden 256 --rounds 5 --refreshes 20   # --strategy deepspeed: ZeRO-3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlrft.models.loading import load_model  # noqa: E402
from vlrft.models.tiny import make_tiny_model  # noqa: E402
from vlrft.rollout import HFEngineConfig, RolloutConfig, make_engine  # noqa: E402
from vlrft.strategies import OptimConfig, StrategyConfig, finish_process, make_strategy  # noqa: E402


def per_parameter(strategy):
    """The stream gathered one parameter at a time (``Strategy._full_tensor``: FSDP2's ``full_tensor``, ZeRO-3's
    ``GatheredParameters``)."""
    for name, param in strategy.unwrap().named_parameters():
        yield name, strategy._full_tensor(param)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default="/tmp/vlrft-bench-weight-sync", help="built here when absent")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vision-depth", type=int, default=6)
    p.add_argument("--vision-hidden", type=int, default=256)
    p.add_argument("--strategy", default="fsdp2", choices=("fsdp2", "deepspeed"), help="deepspeed: ZeRO-3")
    p.add_argument("--mixed-precision", default="no", choices=("no", "bf16"))
    p.add_argument("--copy-dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=5, help="rounds per side, the first uncounted")
    p.add_argument("--refreshes", type=int, default=20, help="refreshes per round")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = StrategyConfig(name=a.strategy, zero_stage=3, mixed_precision=a.mixed_precision)
    strategy = make_strategy(cfg, OptimConfig())
    model_dir = Path(a.model_dir)
    if strategy.is_rank0 and not (model_dir / "config.json").is_file():
        sizes = dict(hidden=a.hidden, layers=a.layers, heads=a.heads, vision_depth=a.vision_depth)
        make_tiny_model(model_dir, arch="qwen2_5_vl", seed=0, vision_hidden=a.vision_hidden, **sizes)
    strategy.barrier()
    model, processor = load_model(str(model_dir), "float32")
    strategy.prepare(model, total_steps=1)
    hf = HFEngineConfig(inference_copy="on", dtype=a.copy_dtype)
    engine = make_engine(RolloutConfig(hf=hf), strategy.unwrap(), processor, synced=strategy.shards_parameters)
    dtype = engine.weight_dtype
    sides = {
        "by unit (vlrft)": lambda: strategy.full_params(dtype=dtype),
        "per parameter": lambda: per_parameter(strategy),
    }
    times: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(a.rounds):
        for side, stream in sides.items():
            strategy.barrier()
            t0 = time.perf_counter()
            for _ in range(a.refreshes):
                engine.update_weights(stream())
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            strategy.barrier()
            if r:
                times[side].append((time.perf_counter() - t0) / a.refreshes)
    every = lambda name, param: True  # noqa: E731
    groups = sum(1 for _ in strategy._gathered_groups(strategy.unwrap(), every, dtype))
    params = sum(1 for _ in strategy.unwrap().parameters())
    if strategy.is_rank0:
        n = sum(t.numel() for t in engine.params.values())
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        name = "ZeRO-3" if a.strategy == "deepspeed" else "FSDP2"
        print(
            f"settings: {strategy.world_size} ranks ({device}), {n / 1e6:.1f} M parameters ({params} tensors), "
            f"{name}, mixed precision {a.mixed_precision}, copy in {str(dtype).removeprefix('torch.')}, "
            f"{a.rounds - 1} x {a.refreshes} counted refreshes per side, torch {torch.__version__}"
        )
        med = {side: statistics.median(t) for side, t in times.items()}
        for side, t in med.items():
            gathers = groups if side.startswith("by unit") else params
            print(f"{side:>16}: {t * 1e3:8.2f} ms per refresh ({gathers} gathers)")
        print(f"ratio (per parameter / by unit): {med['per parameter'] / med['by unit (vlrft)']:.2f}x")
    strategy.barrier()


if __name__ == "__main__":
    main()
    sys.exit(finish_process(0))
