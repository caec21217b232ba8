"""Failures with a known cause.

A :class:`KnownError` carries one message that names the file, key or value at fault and the rule it
broke; the CLI prints that message (no traceback unless ``--debug``) and exits with code 2. Subclass it
for each family of known failures (checkpoints, run folders, numerics, distributed, ...). Errors raised
below ``vlrft`` (``data_pipelines.errors.DataError``, ``vlrft.config.ConfigError``) are listed next to it in
the CLI's table of known failures.
"""

from __future__ import annotations


class KnownError(RuntimeError):
    """A failure with a known cause and a complete, user-facing message."""

    exit_code = 2  # what the CLI exits with


class Preempted(KnownError):
    """The run was asked to stop (SIGTERM, or a configured early-warning signal such as SIGUSR1) and stopped
    after a complete checkpoint; the same command continues it. Exit code 75 (EX_TEMPFAIL): a scheduler can
    requeue on it."""

    exit_code = 75


class NonFiniteError(KnownError):
    """Training produced non-finite values (loss, gradients, rewards, advantages or weights) for too long,
    or weights that cannot be written; nothing non-finite was saved."""


class CheckpointError(KnownError):
    """A checkpoint that cannot be resumed from (incomplete, damaged, or failing its manifest)."""


class StorageError(KnownError):
    """A checkpoint or an export that could not be written because the storage refused it (disk full, quota,
    file-size limit); what was complete before is left as it was."""


class ModelFolderError(KnownError):
    """A model folder whose weights cannot be read whole (a truncated or damaged safetensors file, a missing
    shard), found from the files' headers before anything loads."""


class RunFolderError(KnownError):
    """A run folder held by another process, or holding another run's outputs."""


class DistributedError(KnownError):
    """A rank of a distributed job was lost (killed, hung or unreachable)."""


class TeacherError(KnownError):
    """On-policy distillation's served teacher (``teacher.url``) cannot be used: it does not answer, serves another
    vocabulary or model, or failed to score more of a step's samples than its fallback allows."""
