"""The ``vlrft`` command line: one entry point, one module per subcommand.

Each module in ``COMMANDS`` defines ``add_parser(subparsers)``, which registers its subcommand and
sets ``func`` to the function that runs it. Heavy imports happen inside those functions, so
``vlrft --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = [
    "vlrft.commands.make_tiny_model",
    "vlrft.commands.train_policy",
    "vlrft.commands.train_sft",
    "vlrft.commands.train_dpo",
    "vlrft.commands.eval",
    "vlrft.commands.prepare_data",
    "vlrft.commands.train_reward_model",
    "vlrft.commands.eval_reward_model",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlrft",
        description="Multimodal reward modeling and reinforcement fine-tuning for Qwen-VL policies.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vlrft.config import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"vlrft {args.command}: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
