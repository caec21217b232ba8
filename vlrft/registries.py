"""What every registry of named implementations shares (strategies, rollout engines, ...): a name claimed once, and
an unknown name refused in one line that suggests the closest known one, as config keys are."""

from __future__ import annotations

import difflib
from typing import Any, Mapping, TypeVar

from vlrft.config import ConfigError

T = TypeVar("T")


def add(table: dict[str, Any], name: str, entry: Any, what: str) -> None:
    """Register ``entry`` under ``name`` in ``table``; a name registered twice (two modules claiming it) is an error."""
    if name in table:
        raise ValueError(f"{what} {name!r} is already registered")
    table[name] = entry


def lookup(table: Mapping[str, T], name: str, what: str) -> T:
    """``table[name]``; an unknown name is a one-line :class:`ConfigError` with a did-you-mean and the known names."""
    if name not in table:
        close = difflib.get_close_matches(name, table, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown {what} {name!r}{hint}; known: {', '.join(table)}")
    return table[name]
