"""One module per ``vlrft`` subcommand (see ``vlrft/cli.py``), and the shared plumbing of the
config-driven ones (``train-policy``, ``train-sft``, ``train-dpo``, ``train-reward-model``)."""

from __future__ import annotations

import argparse
import importlib
import math
from pathlib import Path
from typing import Any, Callable

from vlrft.config import ConfigError, input_paths, load_config, to_yaml
from vlrft.config_help import describe, file_keys
from vlrft.run_folder import check_clearable

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # where vlrft/ lies: embedded files are named from here

# a config schema: its class, or "module:Class", imported when a command needs it (help or run), not when the
# parser is built: the config classes live beside torch and transformers, and `vlrft --help` imports none of them
Schema = type | str


def schema_class(schema: Schema) -> type:
    """The config class a :data:`Schema` names."""
    if isinstance(schema, str):
        module, _, name = schema.partition(":")
        return getattr(importlib.import_module(module), name)
    return schema


def config_parser(
    sub: argparse._SubParsersAction,
    name: str,
    *,
    schema: Schema,
    default: str | Path | None,
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """A subcommand taking ``[--print-config] [CONFIG.yaml ...] [key.sub=value ...]`` (read them with
    :func:`config_from_args`); ``default`` is the embedded config used when no CONFIG is given. ``--help`` lists
    every config key with the value a run without CONFIG gets."""
    p = sub.add_parser(
        name,
        help=help,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    p.add_argument("-h", "--help", action=ConfigHelp, epilog=lambda: config_help(schema, default))
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved, validated config a run would use (YAML, as written to OUTPUT_DIR/config.yaml) "
        "and exit without loading a model",
    )
    p.add_argument(
        "items",
        nargs="*",
        metavar="[CONFIG.yaml ...] [key=value ...]",
        help="optional YAML configs (later ones win), then dotted overrides such as train.max_steps=100",
    )
    p.set_defaults(config_schema=schema, config_default=default)
    return p


def add_config_command(
    sub: argparse._SubParsersAction,
    name: str,
    *,
    schema: Schema,
    default: str | Path | None,
    help: str,
    description: str,
    train: Callable[[Any], object],
) -> argparse.ArgumentParser:
    """A training subcommand (:func:`config_parser`) that runs ``train(config)`` in ``train.output_dir``."""
    p = config_parser(sub, name, schema=schema, default=default, help=help, description=description)

    def run(args: argparse.Namespace) -> int:
        cfg = config_from_args(schema, args.items, default)
        if args.print_config:
            print(to_yaml(cfg), end="")
            return 0
        files = split_config_args(args.items)[0]
        # before preflight; the driver checks again (without the config files, which only the command line knows)
        inputs = input_paths(cfg) + [("config file", str(path)) for path in files]
        check_clearable(Path(cfg.train.output_dir), cfg.train.resume, cfg.train.overwrite, inputs)
        from vlrft.trainer.preflight import warn_at_start  # a tiny model at a real model's rate, unused settings

        # what the run starts from before the user's files and overrides: the embedded demo where none is given
        warn_at_start(cfg, name, load_config(schema_class(schema), None if files else default, []))
        train(cfg)
        return 0

    p.set_defaults(func=run)
    return p


class ConfigHelp(argparse.Action):
    """``-h``/``--help`` of a config-driven command: its epilog resolves the embedded config, so it is built
    only when help is asked for (not on every run)."""

    def __init__(self, option_strings: list[str], dest: str, epilog: Callable[[], str]) -> None:
        super().__init__(
            option_strings,
            argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            nargs=0,
            help="show this help message and exit",
        )
        self.epilog = epilog

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.epilog = self.epilog()
        parser.print_help()
        parser.exit()


def config_help(schema: Schema, default: str | Path | None) -> str:
    """The epilog of a config-driven command: every key with the value of a run without CONFIG, resolved as
    :func:`config_from_args` resolves it, the keys the embedded file sets marked ``[demo]``."""
    schema = schema_class(schema)
    values = load_config(schema, default, [])
    if default is None:
        header = "defaults shown are those of a run with no CONFIG: the schema defaults"
        marked: set[str] = set()
    else:
        path = Path(default).resolve()
        where = path.relative_to(PACKAGE_ROOT) if path.is_relative_to(PACKAGE_ROOT) else path
        header = (
            f"defaults shown are those of a run with no CONFIG: the embedded {where} over the schema defaults; "
            f"[demo] marks a value set by {path.name}"
        )
        marked = file_keys(path)
    lines = describe(schema, values=values, marked=marked, mark="demo")
    return "config keys (YAML or key.sub=value); " + header + ":\n" + "\n".join(lines)


def check_flag_rules(*rules: tuple[str, Any, bool, str]) -> None:
    """``(flag, value, ok, rule)`` rows: the first value that breaks its rule (or is NaN or infinite, which fail every
    rule: ``--temperature inf`` is ``>= 0``) is a one-line ConfigError."""
    for flag, value, ok, rule in rules:
        finite = not isinstance(value, float) or math.isfinite(value)
        if not ok or not finite:
            raise ConfigError(f"{flag} {value}: {'' if finite else 'not finite; '}must be {rule}")


def split_config_args(items: list[str]) -> tuple[list[str], list[str]]:
    """``[CONFIG.yaml ...] key=value ...`` -> (config paths, later ones winning; overrides)."""
    n = next((i for i, item in enumerate(items) if "=" in item), len(items))
    return list(items[:n]), list(items[n:])


def config_from_args(schema: Schema, items: list[str], default: str | Path | None = None) -> Any:
    """The validated config of a config-driven command (``default`` when no CONFIG is given)."""
    paths, overrides = split_config_args(items)
    return load_config(schema_class(schema), paths or default, overrides)
