"""One module per ``vlrft`` subcommand (see ``vlrft/cli.py``), and the shared plumbing of the
config-driven ones (``train-policy``, ``train-reward-model``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable


def add_config_command(
    sub: argparse._SubParsersAction,
    name: str,
    *,
    schema: type,
    help: str,
    description: str,
    func: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    """A subcommand taking ``[CONFIG.yaml ...] [key.sub=value ...]``; ``--help`` lists every config key."""
    from vlrft.config import describe

    p = sub.add_parser(
        name,
        help=help,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (YAML or key.sub=value):\n" + "\n".join(describe(schema)),
    )
    p.add_argument(
        "items",
        nargs="*",
        metavar="[CONFIG.yaml ...] [key=value ...]",
        help="optional YAML configs (later ones win), then dotted overrides such as train.max_steps=100",
    )
    p.set_defaults(func=func)
    return p


def split_config_args(items: list[str]) -> tuple[list[str], list[str]]:
    """``[CONFIG.yaml ...] key=value ...`` -> (config paths, later ones winning; overrides)."""
    n = next((i for i, item in enumerate(items) if "=" in item), len(items))
    return list(items[:n]), list(items[n:])


def config_from_args(schema: type, items: list[str], default: str | Path | None = None) -> Any:
    """The validated config of a config-driven command (``default`` when no CONFIG is given)."""
    from vlrft.config import load_config

    paths, overrides = split_config_args(items)
    return load_config(schema, paths or default, overrides)
