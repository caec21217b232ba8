"""``vlrft eval``: run a policy on a benchmark and score it, or compare finished runs (``--compare``)."""

from __future__ import annotations

import argparse

from vlrft.commands import check_flag_rules


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a policy on GSM8K, Geometry3K or your own prompt records; compare runs",
        description="Generate responses with a policy, score them with the benchmark's rule verifier and write "
        "samples.jsonl, metrics.json and a self-contained report.html to --out. An interrupted run started "
        "again with the same --out continues where it stopped. With --compare DIR..., print and write "
        "(to --out, default .) a table of finished runs' metrics. See docs/eval.md.",
    )
    p.add_argument("--benchmark", help="gsm8k, gsm8k_flexible, geo3k, geo3k_mc, or a name of your own with --verifier")
    p.add_argument(
        "--model",
        help="HF model folder, train-policy run folder (uses its final/ model) or hub id (online, or cached)",
    )
    p.add_argument(
        "--data", help="benchmark data: GSM8K jsonl/parquet, Geometry3K InterGPS folder or parquet, or prompt records"
    )
    p.add_argument("--split", default="test", help="split to read from --data folders (default test)")
    p.add_argument(
        "--verifier",
        help="verifier for a user benchmark (or to override a built-in one's): a registered name, or your reward "
        "function path/to/file.py:name (called with one sample; correct when its score is above 0.5)",
    )
    p.add_argument(
        "--prompt-template", help="PROMPT_TEMPLATES name or format string with {prompt} (default: the benchmark's)"
    )
    p.add_argument("--system-prompt", help="system prompt for records without their own")
    p.add_argument("--n", type=int, default=1, help="samples per problem (default 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, > 0 samples (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="generation length limit (default 512)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (default 8)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (batch i uses seed + i; default 0)")
    p.add_argument("--limit", type=int, help="evaluate only the first N problems")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="model dtype (default: as saved)"
    )
    p.add_argument(
        "--cpu-matmul",
        default="auto",
        choices=["auto", "onednn", "mkl"],
        help="the hf engine's float32 linear layers on a CPU: as train-policy's strategy.cpu_matmul (default auto: "
        "oneDNN on AVX-512 CPUs that are not Intel's, where MKL keeps to AVX2)",
    )
    p.add_argument(
        "--max-pixels",
        type=int,
        default=None,
        help="resize images to at most this many pixels (default: the processor decides)",
    )
    p.add_argument(
        "--engine",
        default=None,
        help="generation engine, a name rollout.engine takes: hf (batched generate; the default) or vllm (needs "
        ".venv-vllm; see docs/train-policy.md); an unknown name is refused with the registered ones",
    )
    p.add_argument(
        "--tools",
        nargs="+",
        metavar="TOOL",
        help="multi-turn with tools (docs/tools.md): zoom, crop, rotate, calculator or path/to/file.py:function; "
        "accuracy is also measured with the tools' answers withheld, blank images and no text (OUT/withheld/)",
    )
    p.add_argument("--max-turns", type=int, default=4, help="assistant turns per trajectory with --tools (default 4)")
    p.add_argument(
        "--max-trajectory-tokens",
        type=int,
        default=1024,
        help="token budget of a trajectory with --tools (default 1024)",
    )
    p.add_argument("--out", default=None, help="output folder (required for an evaluation)")
    p.add_argument("--overwrite", action="store_true", help="start over instead of resuming from --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--compare", nargs="+", metavar="RUN_DIR", help="compare finished runs instead of evaluating")
    p.set_defaults(func=run)


def check_sampling_args(args: argparse.Namespace) -> None:
    """Sampling values that make no sense are refused before the model loads."""
    check_flag_rules(
        ("--temperature", args.temperature, args.temperature >= 0, ">= 0 (0: greedy)"),
        ("--top-p", args.top_p, 0 < args.top_p <= 1, "> 0 and <= 1"),
        ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, ">= 1"),
        ("--n", args.n, args.n >= 1, ">= 1"),
        ("--batch-size", args.batch_size, args.batch_size >= 1, ">= 1"),
        ("--limit", args.limit, args.limit is None or args.limit >= 1, ">= 1"),
    )


def check_tasks(records: list, bench, data: str) -> None:
    """A built-in benchmark refuses records of another task (they would silently score 0), with the counts."""
    from collections import Counter

    from data_pipelines.errors import DataError

    if bench.task is None:
        return
    other = Counter(r.task for r in records if r.task != bench.task)
    if other:
        found = ", ".join(f"{n} with task {t!r}" for t, n in other.most_common())
        raise DataError(
            f"{sum(other.values())} of {len(records)} records are not {bench.task!r} records ({found}), so "
            f"--benchmark {bench.name} cannot score them; pick the benchmark of their task, or evaluate them as "
            "your own benchmark (--benchmark NAME --verifier VERIFIER)",
            category="task mismatch",
            source=data,
        )


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vlrft.config import ConfigError

    if args.compare:
        from eval.report import compare_runs

        table, rows = compare_runs(args.compare)
        out = Path(args.out or ".")
        out.mkdir(parents=True, exist_ok=True)
        (out / "comparison.md").write_text(table, encoding="utf-8")
        import json

        (out / "comparison.json").write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
        print(table, end="")
        print(f"wrote {out / 'comparison.md'} and {out / 'comparison.json'}")
        return 0
    missing = [f"--{k}" for k in ("benchmark", "model", "data", "out") if getattr(args, k) is None]
    if missing:
        raise ConfigError(f"an evaluation needs {', '.join(missing)} (or use --compare DIR ...)")
    check_sampling_args(args)
    from vlrft.run_folder import check_output_dir

    check_output_dir(args.out, "--out")  # a file, under a file, unwritable: before anything loads

    import torch
    from transformers import AutoConfig

    from data_pipelines.readers import filter_by_prompt_length
    from eval.benchmarks import get_benchmark
    from eval.runner import check_out_dir, evaluate, run_settings
    from vlrft.models.loading import load_model, load_processor, resolve_model_path
    from vlrft.rollout import DEFAULT_ENGINE, RolloutConfig, make_engine
    from vlrft.rollout.registry import engine_entry
    from vlrft.strategies import StrategyConfig, adapt_for_device
    from vlrft.trainer.preflight import check_model_folder

    rollout = RolloutConfig.on_model(args.engine or DEFAULT_ENGINE, args.batch_size)
    engine_entry(rollout.engine)  # an unknown engine: one line, before the model loads
    try:
        bench = get_benchmark(args.benchmark, verifier=args.verifier, prompt_template=args.prompt_template)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not Path(args.model).expanduser().exists():  # as train-policy says it: a missing folder, or a hub id not
        check_model_folder(args.model, "--model")  # cached offline (a local path is never taken for a hub id)
    try:  # a model folder, a train-policy run folder (its final/ model) or a hub id
        path = resolve_model_path(args.model)
    except FileNotFoundError as exc:
        raise ConfigError(f"--model {exc}") from None
    if Path(path).is_dir():  # config, tokenizer and processor files, before the model loads
        check_model_folder(path, "--model")
    records = bench.load(args.data, split=args.split, limit=args.limit)
    check_tasks(records, bench, args.data)
    sampling = dict(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        system_prompt=args.system_prompt,
    )
    run_info = {"model": str(args.model), "data": str(args.data), "split": args.split, "limit": args.limit}
    if args.tools:
        run_info.update(tools=list(args.tools), max_turns=args.max_turns, tools_withheld=False)
    check_out_dir(args.out, run_settings(bench, len(records), **sampling, run_info=run_info), not args.overwrite)
    # a prompt past the model's positions fails or degrades only when its batch comes up: count them all now,
    # without reading images (a lower bound for image records), from the tokenizer alone
    processor = load_processor(path)
    positions = getattr(AutoConfig.from_pretrained(path).get_text_config(), "max_position_embeddings", None)
    if positions is not None:
        filter_by_prompt_length(
            records,
            processor,
            positions,
            system_prompt=args.system_prompt,
            prompt_template=bench.prompt_template,
            images=False,
            limit_name="the model's max_position_embeddings",
        )
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tools = None
    if args.tools:
        from data_pipelines.collate import processor_image_kwargs
        from vlrft.rollout.trajectories import TrajectoryRunner
        from vlrft.tools import ToolBox, ToolsConfig

        tools_cfg = ToolsConfig(names=list(args.tools), max_turns=args.max_turns, max_tokens=args.max_trajectory_tokens)
        tools = ToolBox(tools_cfg, processor_image_kwargs(processor))  # tools that do not load stop here
    model, _ = load_model(path, args.dtype, device, processor=False)
    adapt_for_device(model, StrategyConfig(cpu_matmul=args.cpu_matmul), device)  # as train-policy's model computes
    image_kwargs = {"max_pixels": args.max_pixels, "min_pixels": None} if args.max_pixels else None
    engine = make_engine(rollout, model, processor)
    runs = {args.out: None}
    if tools is not None:  # with the tools, then with their answers withheld
        runs = {
            args.out: TrajectoryRunner(engine, processor, tools, tools.cfg),
            str(Path(args.out) / "withheld"): TrajectoryRunner(engine, processor, tools, tools.cfg, withheld=True),
        }
    try:
        for out, trajectories in runs.items():
            metrics = evaluate(
                model,
                processor,
                records,
                bench,
                **sampling,
                out_dir=out,
                resume=not args.overwrite,
                progress=not args.no_progress,
                image_kwargs=image_kwargs,
                engine=engine,
                run_info={**run_info, "tools_withheld": True} if out != args.out else run_info,
                trajectories=trajectories,
            )
            lo, hi = metrics["accuracy_ci95"]
            what = "" if out == args.out else " with the tools' answers withheld"
            print(
                f"{bench.name}{what}: accuracy {metrics['accuracy']:.4f} (95% CI {lo:.4f}-{hi:.4f}) on "
                f"{metrics['num_problems']} problems, format rate {metrics['format_rate']:.4f}"
                + (f", tool calls per problem {metrics['tools/calls']:.2f}" if "tools/calls" in metrics else "")
            )
            print(f"wrote {out}/metrics.json, samples.jsonl, report.html")
    finally:
        if tools is not None:
            tools.close()
    return 0
