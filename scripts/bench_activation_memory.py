"""Peak memory of one training forward + backward with and without ``strategy.gradient_checkpointing``.

Each setting runs in a fresh process: a random Qwen2.5-VL of the asked shape (``scripts/bench_grpo_step.py``'s
model options) is prepared by the single strategy (its switch: transformers' activation checkpointing in training
mode), then forward + backward passes of the policy's own loss path run on ``--rows`` sequences of ``--tokens``
tokens (one image each). Memory: on a GPU ``torch.cuda.max_memory_allocated`` above what was allocated before the
forward; on CPU the peak resident set above the resident set before it (the activations and the gradients; the
weights are already resident). Prints one line per setting and their ratio::

    python scripts/bench_activation_memory.py --hidden 512 --layers 6 --heads 4 --vision-depth 6 \\
        --vision-hidden 256 --image-tokens 144 --rows 4 --tokens 1024

Four passes of forward + backward: the first is not measured (with ``--compile-blocks``, which measures each setting
with ``strategy.compile_blocks`` too, it compiles the blocks), the second measures the memory, the fourth the time.
On CPU the first two map every allocation of 128 KiB or more afresh and unmap it when freed (glibc's
``M_MMAP_THRESHOLD`` fixed, ``strategy.keep_freed_memory=no``: the second pass's resident set shows what it
allocates, not what the first left in the heap); the last two keep freed memory, as CPU training does
(``keep_freed_memory``, whose first pass fills the heap), so that the time is not the page faults'.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import torch  # noqa: E402
from bench_grpo_step import PeakMemory, model_folder  # noqa: E402


def measure(a: argparse.Namespace) -> dict:
    """One forward + backward in this process; returns the memory it took and the time."""
    from data_pipelines.collate import collate_sequences, encode_prompt
    from data_pipelines.synthetic import make_prompt_records
    from vlrft.models.loading import load_model
    from vlrft.strategies import OptimConfig, StrategyConfig, make_strategy
    from vlrft.strategies.process import keep_freed_memory
    from vlrft.trainer.experience import response_logprobs, response_tensors

    torch.set_num_threads(a.threads)
    model, proc = load_model(a.model_dir)
    cfg = StrategyConfig(
        gradient_checkpointing=a.checkpointing, compile_blocks=a.compiled, mixed_precision="no", keep_freed_memory="no"
    )
    strategy = make_strategy(cfg, OptimConfig())
    strategy.prepare(model)
    records = make_prompt_records("color", a.rows, seed=0)
    prompts = [encode_prompt(proc, r) for r in records]
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(0, 900, (a.tokens - p.input_ids.numel(),), generator=g) for p in prompts]
    batch = collate_sequences(prompts, list(range(a.rows)), responses, proc.tokenizer.pad_token_id)
    ids, mask = response_tensors(responses, proc.tokenizer.pad_token_id)
    module = strategy.train_module
    cuda = torch.cuda.is_available()

    def loss() -> torch.Tensor:
        logp, _ = response_logprobs(module, batch, ids)
        return -(logp * mask.to(logp.device)).sum() / mask.sum()

    if not cuda:
        _map_every_large_allocation()
    loss().backward()  # not measured (compiles the blocks where they are compiled)
    module.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else psutil.Process().memory_info().rss
    with PeakMemory() as mem:
        loss().backward()
        if cuda:
            torch.cuda.synchronize()
    module.zero_grad(set_to_none=True)
    if not cuda:
        keep_freed_memory()
    loss().backward()  # not measured (fills the heap)
    module.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss().backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {
        "gradient_checkpointing": a.checkpointing,
        "compile_blocks": a.compiled,
        "peak_above_before_mib": round((mem.peak - before) / 2**20, 1),
        "seconds": round(seconds, 2),
        "memory": "cuda max_memory_allocated" if cuda else "resident set",
        "tokens": int(batch["attention_mask"].sum()),
    }


def _map_every_large_allocation() -> None:
    """glibc's malloc maps each allocation of 128 KiB or more afresh and unmaps it when freed (a fixed
    ``M_MMAP_THRESHOLD``, which glibc would otherwise raise as large blocks are freed, keeping them in the heap)."""
    from vlrft.strategies.process import M_MMAP_THRESHOLD, mallopt

    mallopt(M_MMAP_THRESHOLD, 128 * 1024)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("hidden", 512), ("layers", 6), ("heads", 4), ("vision-depth", 6), ("vision-hidden", 256)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--image-tokens", type=int, default=144)
    p.add_argument("--rows", type=int, default=4, help="sequences in the forward")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per sequence (prompt + response)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model-dir", default="", help="(internal) the model folder; --checkpointing: the setting")
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compile-blocks", action="store_true", help="each setting with compiled blocks too")
    a = p.parse_args()
    if a.model_dir:  # a child: one setting
        print(json.dumps(measure(a)), flush=True)
        return
    model_dir = model_folder(Path(tempfile.mkdtemp(prefix="bench-actmem-")), a)
    rows = []
    for compiled in (False, True) if a.compile_blocks else (False,):
        for on in (False, True):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--model-dir", str(model_dir)]
            cmd += ["--checkpointing"] * on + ["--compiled"] * compiled
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    print(
        f"torch {torch.__version__}, {a.rows} x {a.tokens} tokens, hidden {a.hidden} x {a.layers} layers, vision "
        f"{a.vision_hidden} x {a.vision_depth}:"
    )
    for off, on in zip(rows[::2], rows[1::2]):
        print(
            f"  {'compiled' if off['compile_blocks'] else 'eager'} blocks: without checkpointing "
            f"{off['peak_above_before_mib']:.0f} MiB, with {on['peak_above_before_mib']:.0f} MiB "
            f"({on['peak_above_before_mib'] / off['peak_above_before_mib']:.2f}x), time {off['seconds']} s -> "
            f"{on['seconds']} s"
        )


if __name__ == "__main__":
    main()
