"""The ``vlrft`` command line: one entry point, one module per subcommand.

Each module in ``COMMANDS`` defines ``add_parser(subparsers)``, which registers its subcommand and
sets ``func`` to the function that runs it. Heavy imports happen inside those functions, so
``vlrft --help`` stays fast.

A failure with a known cause (``KNOWN_FAILURES``) prints one line, ``vlrft COMMAND: KIND: MESSAGE``, on
stderr and exits with code 2 (75 for a preempted run, which the same command continues); ``--debug`` (or
``VLRFT_DEBUG=1``) shows its traceback too. Any other exception keeps its traceback. Ctrl-C is one line too (what it
cost the command: ``INTERRUPTED``), exit code 130.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

from data_pipelines.errors import DataError
from vlrft import __version__
from vlrft.config import ConfigError
from vlrft.errors import KnownError, Preempted

# exception class -> the kind named in the one-line message (the first matching class wins; reward-source,
# checkpoint, run-folder, numerical and distributed failures are KnownError subclasses)
KNOWN_FAILURES: dict[type[BaseException], str] = {
    ConfigError: "config error",
    DataError: "data error",
    Preempted: "preempted",
    KnownError: "error",
}

# third-party log lines that say nothing to our users, filtered by logger and exact message. DeepSpeed is
# imported by accelerate on every save_pretrained (extract_model_from_parallel checks for DeepSpeedEngine),
# whatever the strategy, and on a machine without a GPU it warns on stdout that it fell back to the CPU.
QUIET_LOGS = {
    "DeepSpeed": ("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",),
}

# what the Ctrl-C line adds for a command (a training run stopped by a second Ctrl-C, or by one before its loop began,
# loses the steps after its last checkpoint; a first Ctrl-C or a preemption signal stops it after the current step
# with a checkpoint instead: vlrft.loop)
_TRAINING = (
    "; the steps after the run's last complete checkpoint are lost (a first Ctrl-C, or `kill -TERM PID`, stops a "
    "run after its current step with a checkpoint instead, and the same command continues it)"
)
INTERRUPTED = {name: _TRAINING for name in ("train-policy", "train-sft", "train-dpo", "train-reward-model")}
INTERRUPTED["eval"] = "; the samples written so far are kept, and the same command continues from them"

COMMANDS = [
    "vlrft.commands.make_tiny_model",
    "vlrft.commands.train_policy",
    "vlrft.commands.train_sft",
    "vlrft.commands.train_dpo",
    "vlrft.commands.eval",
    "vlrft.commands.prepare_data",
    "vlrft.commands.train_reward_model",
    "vlrft.commands.eval_reward_model",
    "vlrft.commands.serve_reward_model",
    "vlrft.commands.probe_rewards",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlrft",
        description="Multimodal reward modeling and reinforcement fine-tuning for Qwen-VL policies.",
    )
    parser.add_argument("--version", action="version", version=f"vlrft {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of known failures too (or set VLRFT_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        importlib.import_module(module).add_parser(sub)
    return parser


def known_failure(exc: BaseException) -> str | None:
    """The kind of a known failure (``"config error"``, ``"data error"``, the ``KnownError`` subclass's name
    in words), or ``None`` for an unexpected exception."""
    for cls, kind in KNOWN_FAILURES.items():
        if isinstance(exc, cls):
            if kind == "error" and type(exc) is not KnownError:  # RewardSourceError -> "reward source error"
                name = type(exc).__name__.removesuffix("Error")
                return "".join(f" {c.lower()}" if c.isupper() else c for c in name).strip() + " error"
            return kind
    return None


def quiet_known_logs() -> None:
    """Drop the :data:`QUIET_LOGS` lines (a filter on the named logger, which its library configures later)."""
    for name, messages in QUIET_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(messages))


class _DropMessages(logging.Filter):
    def __init__(self, messages: tuple[str, ...]) -> None:
        super().__init__()
        self.messages = set(messages)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.messages


def main(argv: list[str] | None = None) -> int:
    if not sys.stderr.isatty():  # a log file: no progress-bar frames from the hub or transformers either
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    quiet_known_logs()
    argv = list(sys.argv[1:] if argv is None else argv)
    flagged = "--debug" in argv  # accepted after the subcommand too (its own arguments end with overrides)
    args = build_parser().parse_args([a for a in argv if a != "--debug"])
    debug = flagged or os.environ.get("VLRFT_DEBUG", "0") not in ("", "0", "false", "False")
    try:
        code = int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line saying what it cost, not a traceback from wherever it landed
        if debug:
            traceback.print_exc()
        print(f"vlrft {args.command}: interrupted (Ctrl-C){INTERRUPTED.get(args.command, '')}", file=sys.stderr)
        code = 130  # 128 + SIGINT, as a shell reports it
    except SystemExit as exc:  # raised deep inside (user code, a library): the command did not finish
        if debug:
            traceback.print_exc()
        from vlrft.user_code import raised_at

        at = f" at {raised_at(exc)[:-2]}" if exc.__traceback__ else ""
        print(f"vlrft {args.command}: error: SystemExit({exc.code!r}) raised{at} ended it unfinished", file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) and exc.code != 0 else 2
    except Exception as exc:
        kind = known_failure(exc)
        if kind is None:
            raise
        if debug:
            traceback.print_exc()
        print(f"vlrft {args.command}: {kind}: {exc}", file=sys.stderr)
        code = exc.exit_code if isinstance(exc, KnownError) else 2
    if "torch.distributed" not in sys.modules:  # nothing imported torch, so no process group to end
        return code
    from vlrft.strategies.process import finish_process

    return finish_process(code)


if __name__ == "__main__":
    sys.exit(main())
