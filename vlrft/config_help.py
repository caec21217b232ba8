"""What ``--help`` shows of a config schema: one line per key (:func:`describe`) with its type, allowed values,
range, help and the value a run gets, and the keys a YAML file sets (:func:`file_keys`, marked ``[demo]``)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from vlrft.config import dotted_keys, range_rule


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def shown_value(value: Any) -> Any:
    """A config value as ``--help`` shows it: plain Python (``ast.literal_eval`` reads its ``repr`` back), a
    dataclass item of a list (a reward source) as a dict of the fields that differ from their defaults."""
    if isinstance(value, list):
        return [shown_value(v) for v in value]
    if isinstance(value, dict):
        return {k: shown_value(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return {
            f.name: shown_value(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if getattr(value, f.name) != field_default(f)
        }
    return value


def file_keys(path: str | Path) -> set[str]:
    """The dotted config keys a YAML file sets (a mapping under a key counts for the key and its children;
    a list is one value)."""
    return set(dotted_keys(OmegaConf.to_container(OmegaConf.load(path))))


def describe(
    schema: type, prefix: str = "", *, values: Any = None, marked: set[str] | frozenset = frozenset(), mark: str = ""
) -> list[str]:
    """One line per config key: dotted name, type, allowed values, default and help.

    The default shown is ``values``'s (a resolved config of ``schema``, e.g. the embedded default a run
    without CONFIG starts from) or, without ``values``, the schema's; keys in ``marked`` get `` [mark]``
    after it. A union field is followed by the keys of its variants in use (``union.describe``)."""
    lines = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        typ = hints[f.name]
        value = field_default(f) if values is None else getattr(values, f.name)
        if dataclasses.is_dataclass(typ):
            lines.append(f"{key}: {f.metadata.get('help', '')}".rstrip())
            lines.extend(describe(typ, key + ".", values=None if values is None else value, marked=marked, mark=mark))
            continue
        union = f.metadata.get("union")
        shown = shown_value(value) if union is None else union.as_data(value)
        default = "(required)" if value is dataclasses.MISSING else repr(shown)
        default += f" [{mark}]" if key in marked else ""
        tname = getattr(typ, "__name__", str(typ).replace("typing.", ""))
        choices = f.metadata.get("choices")
        extra = f" {{{', '.join(map(str, choices))}}}" if choices else ""
        extra += f", {range_rule(f.metadata)}" if range_rule(f.metadata) else ""
        lines.append(f"  {key} ({tname}{extra}, default {default}): {f.metadata.get('help', '')}")
        lines.extend(union.describe(key, value) if union is not None else [])
    return lines
