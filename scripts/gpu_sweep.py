"""The before/after configurations of issue 27 (the GPU fast path) on one GPU, one ``gpu_check.py`` process each.

Every configuration writes ``JSON_DIR/NAME.json`` after each of its steps (``gpu_check.py --json-dir``), so a call
cut by a time limit keeps the steps it finished; a configuration whose JSON says ``"complete": true`` is skipped,
so the same command continues a cut sweep. Configurations (each adds one item to the previous one)::

    before      issue 15's settings: the hf engine on the FSDP2 module, eager decode, micro-batches of 1, bf16
    copy        + item 1: the inference copy (bf16)
    compiled    + item 2: static KV cache, compiled decode
    tokens      + item 3: micro-batches by a token budget (--budget tokens)
    fp32        item 3 without item 4: fp32 compute (mixed_precision no), to show what bf16 buys
    ckpt        item 3 with gradient checkpointing (the memory it saves)
    keep        item 3 with the copy kept on the GPU during the update (rollout.hf.sleep_level=0)
    drop        item 3 with the copy's weights dropped during the update (rollout.hf.sleep_level=2)
    7b          the 7B shape, bf16 parameters and AdamW state, checkpointing, items 1-3, --steps steps
    wide        ckpt with 4x the prompts (8 x 8 samples) in one micro-batch of 4x the budget: the update's host cost
                per micro-batch (its kernel launches) does not grow with the tokens, so its MFU does
    blocks      tokens with each transformer block compiled (strategy.compile_blocks): the update's element-wise
                operators fused, fewer launches at the same tokens
    ckpt-blocks ckpt with compiled blocks (each checkpointed around its compiled forward): what fits an 80 GB card
    wide-blocks wide with compiled blocks: the most tokens per launch

    python scripts/gpu_sweep.py --model-dir /tmp/m3b --json-dir gpu27 [--only before,copy] [--steps 3]
    python scripts/gpu_sweep.py --shape tiny --model-dir /tmp/mtiny --json-dir /tmp/sweep --steps 1   # a CPU smoke
    python scripts/gpu_sweep.py --model-dir /tmp/m3b --json-dir gpu27-80gb --only 7b,ckpt-blocks --memory-cap-gib 79.2
        # on a larger GPU, as an 80 GB H100 would run them: whether they fit, fragmentation included
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

ITEMS = {
    "before": ["--inference-copy", "off", "--compile", "off", "--micro-train-batch", "1", "--mixed-precision", "bf16"],
    "copy": ["--inference-copy", "on", "--compile", "off", "--micro-train-batch", "1", "--mixed-precision", "bf16"],
    "compiled": ["--inference-copy", "on", "--compile", "on", "--micro-train-batch", "1", "--mixed-precision", "bf16"],
}
ITEMS["tokens"] = ITEMS["compiled"][:-4] + ["--micro-train-batch", "16", "--mixed-precision", "bf16"]
ITEMS["fp32"] = ITEMS["tokens"][:-2] + ["--mixed-precision", "no"]
ITEMS["ckpt"] = ITEMS["tokens"] + ["--gradient-checkpointing"]
ITEMS["keep"] = ITEMS["tokens"] + ["--sleep-level", "0"]
ITEMS["drop"] = ITEMS["tokens"] + ["--sleep-level", "2"]
ITEMS["blocks"] = ITEMS["tokens"] + ["--compile-blocks"]
ITEMS["ckpt-blocks"] = ITEMS["ckpt"] + ["--compile-blocks"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="3b", choices=("tiny", "3b"))
    p.add_argument("--model-dir", type=Path, required=True, help="the --shape model (built there when absent)")
    p.add_argument("--model-dir-7b", type=Path, default=None, help="the 7B model (default: MODEL_DIR-7b)")
    p.add_argument("--json-dir", type=Path, required=True)
    p.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget", type=int, default=16384, help="train.micro_batch_tokens of the token-budget runs")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--image-tokens", type=int, default=1024)
    p.add_argument("--profile-step", type=int, default=0, help="gpu_check.py --profile-step (0: no profile)")
    p.add_argument(
        "--memory-cap-gib", type=float, default=0.0, help="gpu_check.py --memory-cap-gib (79.2: run as an 80 GB H100)"
    )
    a = p.parse_args()
    configs = {k: [*v, "--shape", a.shape, "--model-dir", str(a.model_dir)] for k, v in ITEMS.items()}
    budget = ["--micro-batch-tokens", str(a.budget)]
    for k in ("tokens", "fp32", "ckpt", "keep", "drop", "blocks", "ckpt-blocks"):
        configs[k] += budget
    big = a.model_dir_7b or Path(f"{a.model_dir}-7b")
    configs["7b"] = [*ITEMS["tokens"], *budget, "--shape", "7b", "--model-dir", str(big)]
    configs["7b"] += ["--model-dtype", "bfloat16", "--gradient-checkpointing"]
    configs["wide"] = [*ITEMS["ckpt"], "--shape", a.shape, "--model-dir", str(a.model_dir), "--prompts", "8"]
    configs["wide"] += ["--micro-batch-tokens", str(4 * a.budget)]
    configs["wide-blocks"] = [*configs["wide"], "--compile-blocks"]
    if a.shape == "tiny":
        del configs["7b"]
    names = [n for n in a.only.split(",") if n] or list(configs)
    common = ["--steps", str(a.steps), "--max-new-tokens", str(a.max_new_tokens), "--image-tokens", str(a.image_tokens)]
    common += ["--profile-step", str(a.profile_step), "--memory-cap-gib", str(a.memory_cap_gib)]
    for name in names:
        done = a.json_dir / f"{name}.json"
        if done.is_file() and json.loads(done.read_text()).get("complete"):
            print(f"[gpu_sweep] {name}: complete, skipped", flush=True)
            continue
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", str(HERE / "gpu_check.py")]
        cmd += [*configs[name], *common, "--json-dir", str(a.json_dir), "--name", name]
        cmd += ["--out-dir", str(a.json_dir / "runs" / name)]
        print(f"[gpu_sweep] {name}: {' '.join(cmd)}", flush=True)
        code = subprocess.run(cmd).returncode
        print(f"[gpu_sweep] {name}: exit code {code}", flush=True)


if __name__ == "__main__":
    main()
