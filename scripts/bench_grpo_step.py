"""Time one GRPO step of vlrft and of TRL's GRPOTrainer side by side, in one process, alternating.

Both train the same randomly initialised Qwen2.5-VL (same initial weights; sizes from ``--hidden --layers
--heads --vision-depth --vision-hidden``, image tokens per prompt from ``--image-tokens``) on the same synthetic
colour prompts with the same group size, response length, temperature, learning rate, token-mean loss
and no KL (TRL: beta=0, loss_type="dapo", scale_rewards="group"; vlrft: the GRPO recipe with
loss_agg_mode=token-mean, kl_coef=0). Blocks of steps alternate between the two so that machine noise
hits both; the first block of each is warm-up and not counted. Prints per side the median step time and
the peak memory (resident set on CPU, allocated on GPU), vlrft's per-phase times, and the ratio.

Efficiency (vlrft): the FLOPs of its update and rollout are counted from the model's shapes per step
(``scripts/gpu_figures.py``): the update 6 x parameters x tokens (decoder: every token it computes, the
group-shared forward's prompt once per group; vision tower: 6 x its parameters x patches; LM head: the response
positions only) plus attention (12 x head width per query-key pair and layer, a response token seeing its
prompt and own past; windowed and full vision blocks); the rollout 2 x (decoder + LM head) parameters per
decoded position (every row of the generate call for every step) plus the prefill once per prompt
(2 x parameters x prompt tokens), the vision tower once per prompt and attention (4 x head width per pair).
Printed per phase: the median FLOPs, the median time, the achieved FLOP/s and its share of this machine's
float32 GEMM rate measured at the same thread count (1024^3 matmuls, the faster of PyTorch's ``mm``, MKL on x86,
and oneDNN's linear kernel: on an AMD EPYC with AVX-512 MKL keeps to AVX2 and oneDNN runs twice as fast) and of
MKL's; the rollout's also against the decode GEMM rate (the model's own decoder and LM head products at the
rollout's rows, weights from memory, in the rollout's dtype and by its linear layers' kernel,
``strategy.cpu_matmul``: what a decode step's products can reach here). ``--sides vlrft`` runs without TRL;
``--engine vllm`` times the vllm engine (run with .venv-vllm/bin/python).

TRL is not a dependency of vlrft; a venv of its own that reuses vlrft's packages (docs/benchmarks.md):

    python3.11 -m venv .venv-trl
    echo "$PWD/.venv/lib/python3.11/site-packages" > .venv-trl/lib/python3.11/site-packages/vlrft-venv.pth
    .venv-trl/bin/pip install --no-deps "trl==1.16.*"
    PYTHONPATH=$PWD .venv-trl/bin/python scripts/bench_grpo_step.py --hidden 512 --layers 6 --heads 4 \
        --vision-depth 6 --vision-hidden 256 --image-tokens 144 --prompts 2 --generations 16 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import psutil  # noqa: E402
import torch  # noqa: E402
from gpu_figures import (
    decode_gemm_flops_per_s,
    experience_work,
    gemm_flops_per_s,
    param_counts,
    rollout_flops,
    update_flops,
)  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig  # noqa: E402

PHASES = ("time/rollout", "time/reward", "time/old_logprobs", "time/ref_logprobs", "time/update")
WORK = ("flops/rollout", "flops/update")  # FLOPs of each phase, counted from the model's shapes (gpu_figures.py)


class PeakMemory:
    """Peak memory while a side runs: CUDA allocated on a GPU, else the process's peak resident set (Linux: the
    kernel's high-water mark ``VmHWM``, reset on entry through ``/proc/self/clear_refs``; elsewhere the resident
    set sampled every 5 ms by a thread, which takes the interpreter lock from the measured code). The RSS also holds
    the other side's resident weights: compare the differences."""

    def __enter__(self):
        self.peak, self._thread = 0, None
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            return self
        try:
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset the high-water mark
        except OSError:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        proc = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            self.peak = torch.cuda.max_memory_allocated()
        elif self._thread is None:
            status = Path("/proc/self/status").read_text()
            self.peak = int(status.split("VmHWM:")[1].split()[0]) * 1024  # kB
        else:
            self._stop.set()
            self._thread.join()


def vlrft_trainer(model_dir: Path, out: Path, a: argparse.Namespace, extra: tuple[str, ...] = ()):
    from data_pipelines.synthetic import make_prompt_records
    from reward_models.pool import RewardPool
    from vlrft.config import load_config
    from vlrft.models.cpu_matmul import uses_onednn
    from vlrft.models.loading import load_model
    from vlrft.strategies import make_strategy
    from vlrft.trainer.config import PolicyTrainConfig
    from vlrft.trainer.policy_trainer import PolicyTrainer

    cfg = load_config(
        PolicyTrainConfig,
        None,
        [
            f"rollout.rollout_batch_size={a.prompts}",
            f"rollout.n_samples_per_prompt={a.generations}",
            f"rollout.max_new_tokens={a.max_new_tokens}",
            f"rollout.micro_rollout_batch_size={a.prompts}",
            f"train.micro_train_batch_size={a.prompts * a.generations}",
            "algorithm.loss_agg_mode=token-mean",
            "algorithm.kl_coef=0",
            f"optim.lr={a.lr}",
            f"train.output_dir={out}",
            "train.max_steps=0",
            "train.log_samples=0",
            "strategy.grad_clip=1.0",
            f"train.shared_prompt_forward={str(a.shared).lower()}",
            f"rollout.engine={a.engine}",
            *a.overrides,
            *extra,
        ],
    )
    strategy = make_strategy(cfg.strategy, cfg.optim)
    model, proc = load_model(str(model_dir))
    pool = RewardPool(cfg.reward)
    records = make_prompt_records("color", 512, seed=0)
    trainer = PolicyTrainer(cfg, strategy, model, proc, records, pool, accuracy=("accuracy", "vocab_answer"))
    trainer.total_steps = 0
    config = model.config
    counts = param_counts(config)

    def run(steps: int, phases: dict[str, list[float]]) -> list[float]:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            metrics: dict = {}
            exp = trainer.make_experience(metrics)
            update, rollout = experience_work(exp, shared=a.shared)
            metrics["flops/update"] = update_flops(config, counts, update)["total"]
            metrics["flops/rollout"] = rollout_flops(config, counts, rollout)["total"]
            trainer.train_on(exp, metrics)
            trainer.engine.update_weights(trainer.strategy.full_params())
            trainer.steps_done += 1
            times.append(time.perf_counter() - t0)
            for k in PHASES + WORK:
                if k in metrics:
                    phases.setdefault(k, []).append(metrics[k])
        return times

    # the dtype the rollout computes in: the hf engine's inference copy's (rollout.hf.dtype), vLLM's
    # (rollout.vllm.dtype), else the policy's
    run.rollout_dtype = trainer.engine.weight_dtype or model.dtype
    # its linear layers' kernel (strategy.cpu_matmul, as the strategy applied it), which the decode GEMM rate is
    # measured with
    run.onednn = uses_onednn(model)
    return run


def trl_trainer(model_dir: Path, out: Path, a: argparse.Namespace):
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import vlrft.models  # noqa: F401
    from data_pipelines.synthetic import make_prompt_records
    from reward_models.verifiers import get_verifier

    records = make_prompt_records("color", 512, seed=0)
    rows = [
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r.prompt}]}],
            "image": r.images[0],
            "answer": r.answer,
            "vocabulary": r.metadata["vocabulary"],
        }
        for r in records
    ]
    dataset = Dataset.from_list(rows)
    verifier = get_verifier("vocab_answer")

    def accuracy(completions, answer, vocabulary, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [verifier(t, g, vocabulary=v).score for t, g, v in zip(texts, answer, vocabulary)]

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    processor = AutoProcessor.from_pretrained(model_dir, padding_side="left")
    state = {"done": 0}

    def run(steps: int, phases: dict[str, list[float]]) -> list[float]:
        times.clear()
        args = GRPOConfig(
            output_dir=str(out),
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            per_device_train_batch_size=a.prompts * a.generations,
            num_generations=a.generations,
            max_completion_length=a.max_new_tokens,
            temperature=1.0,
            learning_rate=a.lr,
            beta=0.0,
            loss_type="dapo",
            scale_rewards="group",
            num_iterations=1,
            gradient_checkpointing=False,
            max_steps=steps,
            logging_steps=10**6,
            seed=state["done"],
            disable_tqdm=True,
            max_grad_norm=1.0,
            lr_scheduler_type="constant",
            warmup_steps=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[accuracy],
            args=args,
            train_dataset=dataset,
            processing_class=processor,
            callbacks=[Clock()],
        )
        trainer.train()
        state["done"] += steps
        return list(times)

    return run


def model_folder(root: Path, a: argparse.Namespace) -> Path:
    """A random Qwen2.5-VL of the asked sizes whose processor gives ``--image-tokens`` tokens per image."""
    from vlrft.models.tiny import make_tiny_model

    sizes = dict(hidden=a.hidden, layers=a.layers, heads=a.heads, vision_depth=a.vision_depth)
    model_dir = make_tiny_model(root / "model", arch="qwen2_5_vl", seed=0, vision_hidden=a.vision_hidden, **sizes)
    if a.image_tokens:  # a square image of exactly this many merged 28 x 28 patches
        cfg_file = model_dir / "processor_config.json"
        cfg = json.loads(cfg_file.read_text())
        edge = a.image_tokens * 28 * 28
        cfg["image_processor"]["size"] = {"shortest_edge": edge, "longest_edge": edge}
        cfg_file.write_text(json.dumps(cfg, indent=2))
    return model_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64, help="LLM hidden size")
    p.add_argument("--layers", type=int, default=2, help="LLM decoder layers")
    p.add_argument("--heads", type=int, default=4, help="LLM attention heads (KV heads: 2)")
    p.add_argument("--vision-depth", type=int, default=2, help="vision tower blocks")
    p.add_argument("--vision-hidden", type=int, default=64, help="vision tower hidden size")
    p.add_argument("--image-tokens", type=int, default=0, help="LLM tokens per image (0: the tiny default, 4-16)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--block", type=int, default=5, help="steps per alternating block")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds counted (after one warm-up round)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument(
        "--sides",
        default="vlrft,trl",
        help="comma-separated: vlrft, trl, vlrft-compiled (vlrft with strategy.compile_blocks=true), vlrft-mkl and "
        "vlrft-onednn (vlrft with strategy.cpu_matmul=mkl / onednn)",
    )
    p.add_argument(
        "--no-shared", dest="shared", action="store_false", help="vlrft with train.shared_prompt_forward=false"
    )
    p.add_argument("--engine", default="hf", choices=("hf", "vllm"), help="vlrft's rollout engine (vllm: .venv-vllm)")
    p.add_argument("overrides", nargs="*", help="more train-policy key=value overrides for vlrft")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    tmp = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    model_dir = model_folder(tmp, a)
    params = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())
    makers = {
        "vlrft": vlrft_trainer,
        "trl": trl_trainer,
        "vlrft-compiled": functools.partial(vlrft_trainer, extra=("strategy.compile_blocks=true",)),
        "vlrft-mkl": functools.partial(vlrft_trainer, extra=("strategy.cpu_matmul=mkl",)),
        "vlrft-onednn": functools.partial(vlrft_trainer, extra=("strategy.cpu_matmul=onednn",)),
    }
    runners = {k: makers[k](model_dir, tmp / k, a) for k in a.sides.split(",")}
    times: dict[str, list[float]] = {k: [] for k in runners}
    peaks: dict[str, int] = {k: 0 for k in runners}
    phases: dict[str, dict[str, list[float]]] = {k: {} for k in runners}
    for rnd in range(a.rounds + 1):
        for name, run in runners.items():
            counted: dict[str, list[float]] = {}
            with PeakMemory() as mem:
                t = run(a.block, counted)
            if rnd > 0:
                times[name] += t
                peaks[name] = max(peaks[name], mem.peak)
                for k, v in counted.items():
                    phases[name].setdefault(k, []).extend(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    load = os.getloadavg()
    print(
        f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, threads {a.threads}, "
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
        + (f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")
    )
    print(
        f"settings: random Qwen2.5-VL {params / 1e6:.1f} M parameters (hidden {a.hidden}, {a.layers} layers, "
        f"{a.heads} heads, vision {a.vision_hidden} x {a.vision_depth}), "
        f"image tokens {a.image_tokens or '4-16'}, {a.prompts} prompts x {a.generations} generations, "
        f"{a.max_new_tokens} new tokens, no KL, token-mean loss, shared prompt forward {a.shared}, "
        f"{a.rounds} x {a.block} steps each, alternating"
    )
    memory = "peak GPU allocated" if torch.cuda.is_available() else "peak RSS"
    for k, v in times.items():
        print(
            f"{k:>6}: median {med[k] * 1000:.0f} ms/step (mean {statistics.mean(v) * 1000:.0f}, "
            f"min {min(v) * 1000:.0f}, max {max(v) * 1000:.0f}, n={len(v)}), {memory} {peaks[k] / 2**20:.0f} MiB"
        )
        if phases[k]:
            parts = ", ".join(
                f"{p.split('/')[1]} {statistics.median(x) * 1000:.0f}" for p, x in phases[k].items() if p in PHASES
            )
            print(f"{'':>6}  phases (median ms): {parts}")
    if "trl" in med and "vlrft" in med:
        print(f"ratio trl / vlrft (median step time): {med['trl'] / med['vlrft']:.2f}x")
    if "vlrft-compiled" in med and "vlrft" in med:
        update = {k: statistics.median(phases[k]["time/update"]) for k in ("vlrft", "vlrft-compiled")}
        print(f"ratio vlrft / vlrft-compiled (median update time): {update['vlrft'] / update['vlrft-compiled']:.2f}x")
    for side in [k for k in runners if k.startswith("vlrft") and phases[k].get("flops/update")]:
        print(f"[{side}]")
        run = runners[side]
        efficiency(phases[side], a, AutoConfig.from_pretrained(model_dir), run.rollout_dtype, run.onednn)


def efficiency(
    phases: dict[str, list[float]], a: argparse.Namespace, config, rollout_dtype: torch.dtype, onednn: bool
) -> None:
    """vlrft's update and rollout against this machine's float32 matmul rate at the same thread count, the faster
    of PyTorch's ``mm`` (MKL) and oneDNN's linear kernel (on an AMD EPYC with AVX-512 MKL keeps to AVX2 and oneDNN
    runs twice as fast: the machine's limit is oneDNN's): FLOPs counted from the model's shapes (gpu_figures.py),
    median per step, over the median phase time; the rollout also against the rate of its own decode products
    (``config``'s weights at the rollout's rows, in the dtype the rollout computes in and by the kernel its linear
    layers use, ``onednn``: a bfloat16 inference copy is measured against bfloat16 products)."""
    from vlrft.models.cpu_matmul import onednn_available

    mkl = gemm_flops_per_s(a.threads)
    dnnl = gemm_flops_per_s(a.threads, onednn=True) if onednn_available() else 0.0
    gemm = max(mkl, dnnl)
    rows = a.prompts * a.generations
    decode = decode_gemm_flops_per_s(config, rows, a.threads, rollout_dtype, onednn=onednn)
    kind = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(rollout_dtype, str(rollout_dtype))
    print(
        f"fp32 GEMM (1024^3 matmuls, {a.threads} thread(s)): {gemm / 1e9:.1f} GFLOP/s, the faster of torch.mm (MKL) "
        f"{mkl / 1e9:.1f} and oneDNN {dnnl / 1e9:.1f}"
    )
    print(
        f"{kind} decode GEMM (the decoder's and LM head's {rows}-row products by {'oneDNN' if onednn else 'F.linear'}, "
        f"weights from memory): {decode / 1e9:.1f} GFLOP/s, {decode / gemm:.0%} of the fp32 GEMM rate"
    )
    for phase in ("update", "rollout"):
        flops = statistics.median(phases[f"flops/{phase}"])
        seconds = statistics.median(phases[f"time/{phase}"])
        rate = flops / seconds
        what = f"{phase} ({a.engine} engine)" if phase == "rollout" else phase
        extra = f", {rate / decode:.0%} of the decode GEMM rate" if phase == "rollout" else ""
        print(
            f"{what}: {flops / 1e9:.1f} GFLOP in {seconds:.2f} s = {rate / 1e9:.1f} GFLOP/s, "
            f"{rate / gemm:.0%} of the GEMM rate ({rate / mkl:.0%} of MKL's){extra}"
        )


if __name__ == "__main__":
    main()
