"""``vlrft eval-reward-model MODEL DATA``: accuracy of a trained reward model on held-out records."""

from __future__ import annotations

import argparse

from vlrft.commands import check_flag_rules
from vlrft.run_folder import check_output_dir, check_output_file


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval-reward-model",
        help="pairwise accuracy of an SRM on preference pairs, or judgment accuracy of a GRM",
        description="Score DATA with the reward model in MODEL (a folder written by train-reward-model: "
        "OUTPUT_DIR/final). An SRM folder (with vlrft_reward_head.json) is scored on preference pairs: "
        "accuracy = share of non-tied pairs with r(chosen) > r(rejected). Any other folder is a judge scored "
        "on judgment records: accuracy = share whose greedy judgment has the target's verdict. DATA is a "
        "file or folder data_pipelines reads, or synthetic:TASK (--synthetic-size held-out records of a run with "
        "train.seed=--seed, the set train-reward-model evaluates on). "
        "With --benchmark, DATA is a preference benchmark (a local copy of VL-RewardBench or Multimodal "
        "RewardBench, or preference records): SRMs, pointwise judges and pairwise judges (--judge-mode "
        "pairwise) are all scored by pairwise accuracy, overall, macro, per category and source (grouped as "
        "each benchmark's authors group them), with seeded bootstrap 95 percent intervals; items without a readable "
        "verdict counted as the authors count them, and again excluded and counted wrong; pairwise judges see "
        "both orders (position-bias figures). Metrics are strict JSON (null for undefined figures). "
        "See docs/reward-models.md.",
    )
    p.add_argument("model", help="reward model folder")
    p.add_argument("data", help="records file/folder, or synthetic:TASK")
    p.add_argument("--batch-size", type=int, default=16, help="records per forward (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="judgment length limit (GRM, default 24)")
    p.add_argument(
        "--judge-mode",
        default="pointwise",
        choices=("pointwise", "pairwise"),
        help="judgment format of the records (GRM, default pointwise)",
    )
    p.add_argument(
        "--synthetic-option",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="option of a synthetic task, e.g. num_colors=2 (repeatable)",
    )
    p.add_argument("--synthetic-size", type=int, default=128, help="synthetic:TASK: records drawn (default 128)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="synthetic:TASK: the train.seed whose held-out records are drawn; --benchmark: the bootstrap "
        "intervals' seed (default 0)",
    )
    p.add_argument(
        "--benchmark",
        default=None,
        choices=("auto", "vlrewardbench", "mmrewardbench", "records"),
        help="DATA is a preference benchmark in this layout (auto: by its fields)",
    )
    p.add_argument(
        "--debias", default="none", choices=("none", "swap"), help="pairwise judges: swap = average both orders"
    )
    p.add_argument(
        "--image-root",
        default=None,
        help="benchmark: relative image paths start here (default: the data file's folder)",
    )
    p.add_argument("--out-dir", default=None, help="benchmark: write metrics.json and report.html here")
    p.add_argument("--on-bad-record", default="error", choices=("error", "skip"), help="bad rows: stop or skip")
    p.add_argument("--out", default=None, help="also write the metrics as (strict) JSON to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eval.reward_benchmarks import evaluate_benchmark
    from reward_models.evaluate import evaluate_reward_model, metrics_json
    from vlrft.trainer.preflight import check_model_folder

    check_flag_rules(
        ("--batch-size", args.batch_size, args.batch_size >= 1, ">= 1"),
        ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, ">= 1"),
        ("--synthetic-size", args.synthetic_size, args.synthetic_size >= 1, ">= 1"),
    )
    if args.out is not None:  # the metrics file: written at the end, so checked before anything is scored
        check_output_file(args.out, "--out")
    if args.out_dir is not None:
        check_output_dir(args.out_dir, "--out-dir")
    # a run folder read as a model would be taken for a judge (it has no reward head) and its data misjudged
    check_model_folder(args.model, "model")
    if args.benchmark:
        metrics = evaluate_benchmark(
            args.model,
            args.data,
            layout=args.benchmark,
            judge_mode=args.judge_mode,
            debias=args.debias,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            on_bad_record=args.on_bad_record,
            image_root=args.image_root,
            out_dir=args.out_dir,
            seed=args.seed,
        )
    else:
        metrics = evaluate_reward_model(
            args.model,
            args.data,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            judge_mode=args.judge_mode,
            on_bad_record=args.on_bad_record,
            synthetic_options={k: int(v) for k, v in (o.split("=", 1) for o in args.synthetic_option)},
            synthetic_size=args.synthetic_size,
            seed=args.seed,
        )
    text = metrics_json(metrics)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0
