"""Overlap of asynchronous RL (issue 59, "Overlap, measured"): ``rollout.mode=async`` with 1 rollout rank and 1
trainer rank (``max_staleness`` 1) against what it overlaps, each side a real ``vlrft train-policy`` run::

    python scripts/bench_async.py [--steps 12]   # the benchmark (docs/benchmarks.md)
    python scripts/bench_async.py --quick        # the smallest sizes, a smoke run

**Workload A, balanced.** The embedded demo (colour task, tiny random Qwen2.5-VL), ``--batch`` prompts x
``--samples``, with the response length chosen so that sampling a step and updating on it take about as long: two
short colocated single-process calibration runs at the two ``--calibrate`` lengths give time/rollout + time/reward
and time/update, each taken as linear in ``rollout.max_new_tokens`` (a random tiny model answers to the length limit),
and the length where they cross is used (``--max-new-tokens`` skips the calibration). Then the async run, from whose
metrics: the step (``time/step``), the rollout rank's busy time per step (samples per step /
``async/rollout_samples_per_s``: sampling and scoring, not its waits for weights), the update (``time/update``), and
the issue's figure step / max(rollout, update) (goal: <= 1.15).

**Workload B, long-tailed.** A quarter of the responses 8x longer than the rest. No option makes a random model's
lengths long-tailed, so the script writes a model whose lengths it controls: the demo's tiny model (same shapes, so
the same work per token) with every decoder block's output projections (attention ``o_proj``, MLP ``down_proj``) set
to zero, which leaves each position's last hidden state its own token's embedding, and embeddings and LM head set so
that the next token depends on the current one only: after any prompt token, one of two chain starts (3 : 1), then
a fixed chain of tokens ending with EOS after ``--short-tokens`` (k) tokens or after 8k. The logit margins (200 against
at most 91 here) make every step but the start certain, so each sample is short or long with probabilities 3/4 and
1/4 (keyed sampling draws the start; the measured long share is printed). The reward is 0 everywhere (the colour
verifier), so advantages are zero and, with no entropy bonus, the gradients too: the model keeps its lengths while the
update does all its usual work. Async (1 rollout + 1 trainer rank, ``max_staleness`` 1), with and without partial
rollouts (``rollout.asynchronous.partial``), against the synchronous 2-rank FSDP2 run (``strategy.name=fsdp2``,
colocated) with the same global batch, all with keyed sampling (async's own), so that with the weights unchanged all
draw the same responses: samples per second (samples per step / mean ``time/step``) and their ratios (the issue's
goal: >= 1.3 with partial rollouts).

Every process runs one torch thread (``OMP_NUM_THREADS=1``); the first ``SKIP`` steps of each run are warm-up and
not counted. Prints the machine, the settings, the exact commands and markdown tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = 2  # warm-up steps of every run, not counted
CALIBRATION_SKIP = 1  # of a calibration run
LOGIT = 200.0  # workload B's chain logits; the rest 0, or below 150 (checked; 91 measured)
# every run: no held-out evaluation, no best model, no collapse alarm (workload B's answers are all alike), no loggers
COMMON = (
    "data.eval_source=",
    "train.eval_every=0",
    "train.keep_best=false",
    "train.overwrite=true",
    "train.collapse_share=1.0",
    "logging.wandb=disabled",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
)
ASYNC = ("rollout.mode=async", "rollout.asynchronous.rollout_ranks=1", "rollout.asynchronous.max_staleness=1")
SYNC = ("strategy.name=fsdp2", "rollout.keyed_sampling=true")  # async samples keyed: the same tokens
RUNS_B = (  # workload B's runs: name, overrides, label
    ("async", ASYNC, "async, 1 rollout + 1 trainer rank"),
    ("partial", (*ASYNC, "rollout.asynchronous.partial=true"), "async with partial rollouts"),
    ("sync", SYNC, "synchronous, 2 FSDP2 ranks"),
)
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def machine() -> str:
    """The CPU model, its cores, the load at start, torch and transformers."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{cpu}, {os.cpu_count()} cores, no GPU used; load average at start {load}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}; one torch thread per process"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(overrides: list[str], nproc: int) -> list[str]:
    """``vlrft train-policy`` (the embedded demo) with ``overrides``: one process, or ``nproc`` under torchrun."""
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    return [*launch, "-m", "vlrft", "train-policy", *COMMON, *overrides]


def shown(cmd: list[str], nproc: int, paths: dict[str, str]) -> str:
    """``cmd`` as a reader types it: torchrun and vlrft by name, the temporary folders as placeholders."""
    cmd = ["torchrun", "--nproc_per_node", str(nproc), *cmd[7:]] if nproc > 1 else ["python", *cmd[1:]]
    text = "OMP_NUM_THREADS=1 " + shlex.join(cmd)
    for path, name in paths.items():
        text = text.replace(path, name)
    return text


def train_policy(label: str, out: Path, overrides: list[str], nproc: int = 1) -> tuple[list[dict], list[str]]:
    """Run train-policy into ``out``; its metrics rows (one per step) and the command."""
    cmd = command([f"train.output_dir={out}", *overrides], nproc)
    env = dict(os.environ, PYTHONPATH=str(ROOT), **ENV)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"{label}: exit {res.returncode}\n$ {shlex.join(cmd)}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step" in r]
    print(f"  {label}: {len(rows)} steps, {time.perf_counter() - t0:.0f} s wall", file=sys.stderr, flush=True)
    return rows, cmd


def counted(rows: list[dict], skip: int = SKIP) -> list[dict]:
    """The rows after the warm-up (the last row if there are no more)."""
    return rows[skip:] or rows[-1:]


def mean(rows: list[dict], key) -> float:
    """The mean over ``rows`` of a metric, or of ``key(row)``."""
    return statistics.fmean(key(r) if callable(key) else r[key] for r in rows)


# ------------------------------------------------------------------------------------------------ workload A
def balanced(batch: int, samples: int, tokens: int) -> list[str]:
    return [
        f"rollout.rollout_batch_size={batch}",
        f"rollout.n_samples_per_prompt={samples}",
        f"rollout.max_new_tokens={tokens}",
    ]


def calibrate(a: argparse.Namespace, tmp: Path) -> tuple[int, list[str]]:
    """The response length at which a colocated step's rollout (sampling and scoring) takes as long as its update,
    from two short single-process runs, each time linear in the length; and the lines that say so."""
    points, lines = [], []
    for tokens in a.calibrate:
        overrides = [*balanced(a.batch, a.samples, tokens), f"train.max_steps={a.calibration_steps}"]
        rows, _ = train_policy(f"A: calibration, colocated, {tokens} tokens", tmp / f"cal-{tokens}", overrides)
        rows = counted(rows, CALIBRATION_SKIP)
        rollout = mean(rows, lambda r: r["time/rollout"] + r["time/reward"])
        update = mean(rows, "time/update")
        points.append((tokens, rollout, update))
        lines.append(f"max_new_tokens {tokens}: rollout {rollout:.3f} s, update {update:.3f} s")
    (t1, r1, u1), (t2, r2, u2) = points
    slope = ((r2 - u2) - (r1 - u1)) / (t2 - t1)  # how fast rollout - update grows with the length
    if slope > 0 and r1 - u1 < 0:  # they cross at a positive length
        tokens = t1 - (r1 - u1) / slope
        chosen = min(max(round(tokens), 1), a.max_tokens_cap)
    else:  # no crossing ahead: the calibrated length nearer balance
        chosen = min(points, key=lambda p: abs(math.log(p[1] / p[2])))[0]
    lines.append(f"chosen max_new_tokens {chosen}")
    return chosen, lines


def workload_a(a: argparse.Namespace, tmp: Path) -> dict:
    if a.max_new_tokens:
        tokens, calibration = a.max_new_tokens, ["max_new_tokens given (--max-new-tokens): no calibration"]
    else:
        tokens, calibration = calibrate(a, tmp)
    overrides = [*balanced(a.batch, a.samples, tokens), *ASYNC, f"train.max_steps={a.steps}"]
    rows, cmd = train_policy("A: async, 1 rollout + 1 trainer", tmp / "a-async", overrides, nproc=2)
    rows = counted(rows)
    per_step = a.batch * a.samples  # every sample of a step is the one rollout rank's
    step = mean(rows, "time/step")
    rollout = mean(rows, lambda r: per_step / r["async/rollout_samples_per_s"])
    update = mean(rows, "time/update")
    trainer = mean(rows, lambda r: r["time/step"] - r["time/rollout"] - r["time/weight_publish"])
    return {
        "tokens": tokens,
        "calibration": calibration,
        "counted": len(rows),
        "step": step,
        "rollout": rollout,
        "update": update,
        "trainer": trainer,
        "publish": mean(rows, "time/weight_publish"),
        "trainer_idle": mean(rows, "async/trainer_idle_share"),
        "rollout_idle": mean(rows, "async/rollout_idle_share"),
        "ratio": step / max(rollout, update),
        "ratio_busy": step / max(rollout, trainer),
        "cmd": cmd,
    }


# ------------------------------------------------------------------------------------------------ workload B
def long_tailed_model(path: Path, short: int, seed: int = 0) -> None:
    """The demo's tiny model (``make_tiny_model`` as train-policy builds it: qwen2_5_vl, hidden 64, 2 layers, seed 0)
    whose responses are ``short`` tokens long (EOS included) with probability 3/4 and ``8 * short`` with 1/4.

    Zero output projections (``o_proj``, ``down_proj``) in every decoder block leave the last hidden state the
    current token's embedding, so the LM head reads a bigram table: every token outside the two chains embeds as
    ``e_0`` and leads to the short chain's start (logit LOGIT + ln 3) or the long one's (LOGIT); each chain token
    embeds as a random unit direction orthogonal to ``e_0`` and leads to its successor (logit LOGIT), the last ones
    to EOS. Checked here: every chain token's successor leads the rest by more than LOGIT / 4."""
    import torch
    from safetensors.torch import load_file, save_file

    from vlrft.models.tiny import make_tiny_model

    make_tiny_model(path, arch="qwen2_5_vl", hidden=64, layers=2, seed=seed)
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    file = path / "model.safetensors"
    sd = load_file(file)
    emb, head = sd["model.embed_tokens.weight"], sd["lm_head.weight"]
    width = emb.shape[1]
    first = 100  # ordinary BPE tokens (the special ones come last)
    short_chain = list(range(first, first + short - 1))
    long_chain = list(range(first + short - 1, first + 9 * short - 2))
    chain = short_chain + long_chain
    dirs = torch.randn(len(chain), width - 1, generator=torch.Generator().manual_seed(seed))
    emb.zero_()
    emb[:, 0] = 1.0
    emb[chain] = torch.cat([torch.zeros(len(chain), 1), dirs / dirs.norm(dim=1, keepdim=True)], dim=1)
    unit = LOGIT / math.sqrt(width)  # RMSNorm makes a unit vector sqrt(width) long
    head.zero_()
    head[short_chain[0], 0] = unit * (1 + math.log(3) / LOGIT)
    head[long_chain[0], 0] = unit
    successor = {}
    for seq in (short_chain, long_chain):
        for tok, nxt in zip(seq, seq[1:] + [eos]):
            head[nxt] += unit * emb[tok]
            successor[tok] = nxt
    for key, value in sd.items():
        if not key.startswith("visual") and key.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            value.zero_()
    sd["model.norm.weight"].fill_(1.0)
    save_file(sd, file, metadata={"format": "pt"})
    logits = (emb * math.sqrt(width) / emb.norm(dim=1, keepdim=True)) @ head.T
    for tok, nxt in successor.items():
        top = logits[tok].topk(2)
        assert top.indices[0] == nxt and top.values[0] - top.values[1] > LOGIT / 4, (tok, top)
    top = logits[0].topk(3)  # token 0 (not in a chain): the two starts, 3 : 1, far ahead of the rest
    assert top.indices[:2].tolist() == [short_chain[0], long_chain[0]] and top.values[1] - top.values[2] > LOGIT / 4


def long_tailed(model: Path, batch: int, samples: int, short: int, steps: int) -> list[str]:
    return [
        f"model.path={model}",
        f"rollout.rollout_batch_size={batch}",
        f"rollout.n_samples_per_prompt={samples}",
        f"rollout.max_new_tokens={8 * short}",
        "algorithm.entropy_coef=0",
        f"train.max_steps={steps}",
    ]


def workload_b(a: argparse.Namespace, tmp: Path) -> dict:
    model = tmp / "long-tailed-model"
    long_tailed_model(model, a.short_tokens)
    base = long_tailed(model, a.batch_b, a.samples_b, a.short_tokens, a.steps)
    per_step = a.batch_b * a.samples_b
    out = {"model": str(model)}
    for name, extra, label in RUNS_B:
        rows, cmd = train_policy(f"B: {label}", tmp / f"b-{name}", [*base, *extra], nproc=2)
        rows = counted(rows)
        length = mean(rows, "response_length/mean")
        step = mean(rows, "time/step")
        run = {"counted": len(rows), "step": step, "samples_per_s": per_step / step, "length": length, "cmd": cmd}
        run["long_share"] = (length - a.short_tokens) / (7 * a.short_tokens)
        run["update"] = mean(rows, "time/update")
        if name != "sync":
            run["rollout"] = mean(rows, lambda r: per_step / r["async/rollout_samples_per_s"])
            run["partial_share"] = mean(rows, "async/partial_share")
        else:  # each rank samples and scores its half
            run["rollout"] = mean(rows, lambda r: r["time/rollout"] + r["time/reward"])
        out[name] = run
    out["ratio"] = out["async"]["samples_per_s"] / out["sync"]["samples_per_s"]
    out["ratio_partial"] = out["partial"]["samples_per_s"] / out["sync"]["samples_per_s"]
    return out


# ------------------------------------------------------------------------------------------------ report
def report(a: argparse.Namespace, host: str, ra: dict, rb: dict, paths: dict[str, str]) -> str:
    lines = [
        f"Machine: {host}.",
        "",
        f"Settings: the embedded demo (`vlrft train-policy`, colour task, tiny random Qwen2.5-VL), hf engine, "
        f"`rollout.asynchronous.max_staleness=1`, `algorithm.off_policy=none`, {a.steps} steps per run, the first "
        f"{SKIP} not counted; no held-out evaluation.",
        "",
        f"**Workload A, balanced**: {a.batch} prompts x {a.samples} samples, `rollout.max_new_tokens={ra['tokens']}` "
        f"(calibration, colocated, 1 process: {'; '.join(ra['calibration'])}).",
        "",
        "| async, 1 rollout + 1 trainer rank | step | rollout (busy) | update | trainer busy | step / max(rollout, "
        "update) | step / max(rollout, trainer busy) |",
        "|---|---|---|---|---|---|---|",
        f"| mean of {ra['counted']} steps | {ra['step']:.3f} s | {ra['rollout']:.3f} s | {ra['update']:.3f} s | "
        f"{ra['trainer']:.3f} s | **{ra['ratio']:.2f}** (goal <= 1.15) | {ra['ratio_busy']:.2f} |",
        "",
        f"Rollout (busy): samples per step / `async/rollout_samples_per_s`; trainer busy: `time/step` - "
        f"`time/rollout` (its wait for the groups) - `time/weight_publish` ({ra['publish']:.3f} s): the update, "
        f"the proximal log-probs of the stale groups, the experience; idle shares: trainer "
        f"{ra['trainer_idle']:.2f}, rollout rank {ra['rollout_idle']:.2f}.",
        "",
        f"**Workload B, long-tailed**: {a.batch_b} prompts x {a.samples_b} samples, responses {a.short_tokens} or "
        f"{8 * a.short_tokens} tokens (probability 3/4 and 1/4, the script's chain model), "
        f"`rollout.max_new_tokens={8 * a.short_tokens}`, `algorithm.entropy_coef=0`; both with keyed sampling (the "
        "same responses).",
        "",
        "| 2 processes | step | samples/s | rollout | update | mean response length (long share) |",
        "|---|---|---|---|---|---|",
    ]
    for name, _, label in RUNS_B:
        r = rb[name]
        lines.append(
            f"| {label} | {r['step']:.3f} s | {r['samples_per_s']:.1f} | {r['rollout']:.3f} s | {r['update']:.3f} s "
            f"| {r['length']:.1f} ({r['long_share']:.2f}) |"
        )
    lines += [
        "",
        f"**async with partial rollouts / synchronous samples/s = {rb['ratio_partial']:.2f}x** (goal >= 1.3); "
        f"async without them / synchronous {rb['ratio']:.2f}x; share of samples with tokens of two versions "
        f"(`async/partial_share`): {rb['partial']['partial_share']:.2f} with partial rollouts. Rollout: async, "
        "the rollout rank's "
        "busy time for the whole batch; synchronous, each rank's `time/rollout` + `time/reward` for its half.",
        "",
        "Commands (`OUT`: a run folder; `MODEL`: the chain model, written by `long_tailed_model` in the script):",
        "",
        "```bash",
        f"python scripts/bench_async.py {' '.join(sys.argv[1:])}".rstrip(),
        shown(ra["cmd"], 2, paths),
        *(shown(rb[name]["cmd"], 2, paths) for name, _, _ in RUNS_B),
        "```",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help=f"steps per run, the first {SKIP} not counted")
    ap.add_argument("--quick", action="store_true", help="the smallest sizes and 3 steps: a smoke run")
    ap.add_argument("--batch", type=int, default=8, help="A: prompts per step")
    ap.add_argument("--samples", type=int, default=16, help="A: samples per prompt")
    ap.add_argument("--calibrate", type=int, nargs=2, default=(4, 16), help="A: the two calibration lengths")
    ap.add_argument("--calibration-steps", type=int, default=4, help="A: steps per calibration run")
    ap.add_argument("--max-tokens-cap", type=int, default=64, help="A: the longest length calibration may choose")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="A: this length, no calibration (0: calibrate)")
    ap.add_argument("--batch-b", type=int, default=8, help="B: prompts per step (a multiple of 2)")
    ap.add_argument("--samples-b", type=int, default=8, help="B: samples per prompt")
    ap.add_argument("--short-tokens", type=int, default=8, help="B: the short responses' length (the long: 8x)")
    ap.add_argument("--keep", default="", help="keep the runs in this folder (default: a temporary one)")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.batch, a.samples, a.calibrate, a.calibration_steps = 3, 2, 2, (1, 2), 2
        a.batch_b, a.samples_b, a.short_tokens = 2, 2, 2
    if a.batch_b % 2 or a.short_tokens < 2 or a.calibrate[0] >= a.calibrate[1]:
        sys.exit("--batch-b must be even (2 FSDP2 ranks), --short-tokens >= 2, --calibrate ascending")
    host = machine()
    print(host, file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-async-") as scratch:
        tmp = Path(a.keep or scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        ra = workload_a(a, tmp)
        rb = workload_b(a, tmp)
        runs = ["a-async", *(f"b-{name}" for name, _, _ in RUNS_B)]  # the folders train_policy wrote
        paths = {str(tmp / name): "OUT" for name in runs} | {rb["model"]: "MODEL"}
        print(report(a, host, ra, rb, paths))
        print(f"\n(all runs: {time.perf_counter() - t0:.0f} s wall)")


if __name__ == "__main__":
    main()
