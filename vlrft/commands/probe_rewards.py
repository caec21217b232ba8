"""``vlrft probe-rewards [CONFIG.yaml ...] [key=value ...]``: score reward-hacking probes through the reward pool
of a train-policy config (``reward_models.probes``); exit code 3 when a probe is flagged."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlrft.commands import check_flag_rules, config_from_args, config_parser
from vlrft.commands.train_policy import DEMO_CONFIG

FLAGGED_EXIT = 3  # a probe was flagged (0: none; 2: a config or data error, as every command)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = config_parser(
        sub,
        "probe-rewards",
        schema="vlrft.trainer.config:PolicyTrainConfig",
        default=DEMO_CONFIG,
        help="score made-up hacks (empty, every answer, junk around the answer, ...) through a config's reward pool",
        description="Build the reward pool of a train-policy config (no CONFIG: the embedded demo), take --records "
        "real records (data.eval_source, else data.train_source) and score, per record, the gold answer, a wrong "
        "one and the probes: empty, whitespace, the vocabulary enumerated, every option, the verdicts enumerated "
        "(judge records), the answer repeated, padded with junk, and a very long response; for reward models the "
        "image replaced by a blank and by another record's image, and for pairwise judges the two positions "
        "swapped. Prints a table, writes OUT/probes.json and OUT/report.html (the flagged cases). Exit code 0: "
        "nothing flagged; 3: a probe flagged; 2: a config or data error. Its options go before or after CONFIG "
        "and the key=value overrides, not between them. See docs/reward-models.md, 'Probing rewards for hacks'.",
    )
    p.add_argument("--records", type=int, default=16, help="records probed (default 16)")
    p.add_argument(
        "--threshold", type=float, default=0.5, help="flag a probe earning this share of the gold's reward (0.5)"
    )
    p.add_argument("--margin", type=float, default=0.1, help="... or more than a wrong answer + margin x the gap (0.1)")
    p.add_argument("--out", default="runs/probe-rewards", help="output folder (default runs/probe-rewards)")
    p.set_defaults(func=run)


def check_probe_args(args: argparse.Namespace) -> None:
    check_flag_rules(
        ("--records", args.records, args.records >= 1, ">= 1"),
        ("--threshold", args.threshold, args.threshold > 0, "> 0"),
        ("--margin", args.margin, args.margin >= 0, ">= 0"),
    )


def probe_records(cfg, n: int) -> tuple[str, list]:
    """``n`` records as train-policy reads them: from ``data.eval_source``, else ``data.train_source`` (a synthetic
    source drawn with the run's seed for it; a file's first ``n``), images sized by the policy's processor."""
    import tempfile

    from data_pipelines.synthetic import heldout_seed, synthetic_task
    from vlrft.models.loading import load_processor
    from vlrft.models.tiny import make_tiny_model
    from vlrft.trainer.run import load_prompt_records

    source = cfg.data.eval_source or cfg.data.train_source
    seed = heldout_seed(cfg.train.seed) if cfg.data.eval_source else cfg.train.seed
    if synthetic_task(source) is not None:
        return source, load_prompt_records(source, cfg, n, seed, None)
    with tempfile.TemporaryDirectory() as tmp:  # no model.path: the tiny model the run would build, for its processor
        m = cfg.model
        path = m.path or make_tiny_model(
            Path(tmp) / "m", arch=m.tiny_arch, hidden=m.tiny_hidden, layers=m.tiny_layers, seed=cfg.strategy.seed
        )
        return source, load_prompt_records(source, cfg, 0, seed, load_processor(path))[:n]


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def table(report) -> str:
    """The console table: probe (and source), mean reward, gold's, ratio, flagged and why."""
    lines = [f"{'probe':<24} {'reward':>9} {'gold':>9} {'ratio':>7}  flagged"]
    for r in report.rows:
        note = (f"ERROR: {r.error}" if r.error else r.why) or (
            f"max |delta| {r.delta:.3g}"
            if r.delta is not None
            else f"position bias {r.position_bias:.3g}"
            if r.position_bias is not None
            else ""
        )
        mark = "FLAGGED " if r.flagged else ""
        lines.append(f"{r.name:<24} {_cell(r.reward):>9} {_cell(r.gold):>9} {_cell(r.ratio):>7}  {mark}{note}".rstrip())
    return "\n".join(lines)


def report_rows(report) -> list[dict]:
    """The flagged cases as rows of the eval report (``eval.report.render_report``)."""
    return [
        {
            "id": c["record"],
            "prompt": c["prompt"],
            "answer": c["answer"],
            "num_correct": 0,
            "heading": f"probe {c['probe']}: {c['why']}",
            "responses": [
                {
                    "text": c["response"],
                    "extracted": f"reward {c['reward']:.4g} (the gold's {c['gold']:.4g})",
                    "correct": False,
                    "mark": "flagged",
                }
            ],
        }
        for c in report.cases
    ]


def run(args: argparse.Namespace) -> int:
    from eval.report import write_report
    from reward_models.evaluate import metrics_json
    from reward_models.pool import RewardPool
    from reward_models.probes import run_probes
    from vlrft.config import to_yaml
    from vlrft.trainer.config import PolicyTrainConfig
    from vlrft.trainer.preflight import preflight_policy

    cfg = config_from_args(PolicyTrainConfig, args.items, DEMO_CONFIG)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    check_probe_args(args)
    preflight_policy(cfg, world=1)  # the reward sources and the records, as train-policy checks them
    source, records = probe_records(cfg, args.records)
    pool = RewardPool(cfg.reward)
    try:
        report = run_probes(pool, records, threshold=args.threshold, margin=args.margin)
    finally:
        pool.close()
    print(
        f"{report.records} records of {source} probed"
        + (f" ({report.unanswered} without an answer left out)" if report.unanswered else "")
    )
    print(table(report))
    for probe, why in report.skipped.items():
        print(f"not applicable: {probe}: " + ", ".join(f"{reason} ({n} records)" for reason, n in why.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probes.json").write_text(metrics_json(report.to_json()) + "\n", encoding="utf-8")
    summary = {"records": report.records, "threshold": report.threshold, "margin": report.margin}
    summary["flagged"] = ", ".join(report.flagged) or "none"
    summary |= {r.name: f"reward {_cell(r.reward)}, gold {_cell(r.gold)}, ratio {_cell(r.ratio)}" for r in report.rows}
    write_report(out / "report.html", summary, report_rows(report), records, title=f"reward probes: {source}")
    print(f"wrote {out / 'probes.json'} and {out / 'report.html'}")
    if report.flagged:
        print(f"flagged: {', '.join(report.flagged)} (docs/reward-models.md, 'Probing rewards for hacks')")
        return FLAGGED_EXIT
    return 0
