"""Tagged unions in configs: a value that is one of several dataclasses, chosen by one of its keys (the reward
sources' ``kind``: ``kind: srm`` takes the keys of the srm source's config, ``kind: http`` those of the http one).

OmegaConf, which merges the defaults, the YAML files and the overrides (:func:`vlrft.config.load_config`), has no
union of dataclasses. A field declared ``option(..., union=TaggedUnion(...))`` (typed ``Any``, or ``list[Any]``
for a list of such values) is therefore merged as plain data, and built into its variant once merging is done
(:meth:`TaggedUnion.build`): the tag picks the dataclass; a key that dataclass does not declare is refused in one
line naming the file or override, the key, its value, the variant and its keys; values are typed by OmegaConf as
in any section, and choices and ranges are checked with the rest of the config. ``--help`` lists the keys of the
variants in use (:meth:`TaggedUnion.describe`), ``--print-config`` prints each value with its own keys only.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import typing
from collections.abc import Mapping
from typing import Any, Callable

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from vlrft.config import ConfigError, explain
from vlrft.config_help import describe, shown_value

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)
class TaggedUnion:
    """``tag``: the key that picks the variant; ``variants``: tag value -> dataclass (a registry, read when used);
    ``default``: the variant of a value without the tag; ``what``: how messages name a value (``reward source``)."""

    tag: str
    variants: Mapping[str, type]
    default: str
    what: str

    def as_data(self, value: Any) -> Any:
        """A built value (or a list of them) as the plain data it merges as: its tag and the keys that differ from
        its variant's defaults (so that an override may change the tag of a default value)."""
        if isinstance(value, list):
            return [self.as_data(v) for v in value]
        if dataclasses.is_dataclass(value):
            return {self.tag: getattr(value, self.tag), **shown_value(value)}
        return value

    def build(self, data: Any, key: str, origin: Callable[[str], str]) -> Any:
        """The variant dataclass of ``data``, the merged value at config key ``key`` (empty: a value of its own);
        ``origin(key)`` names the file or override that set a key, for the one-line
        :class:`~vlrft.config.ConfigError` of a bad one."""
        kinds, under = ", ".join(self.variants), f"{key}." if key else ""
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"{origin(key)}: config key '{key}' = {data!r}: must be a mapping of a {self.what}'s keys "
                f"({self.tag}: {kinds})"
            )
        tag = data.get(self.tag, self.default)
        if not isinstance(tag, str) or tag not in self.variants:
            raise ConfigError(
                f"{origin(key)}: config key '{under}{self.tag}' = {tag!r} is not allowed; choose one of: {kinds}"
            )
        variant = self.variants[tag]
        names = [f.name for f in dataclasses.fields(variant)]
        legacy = []  # other variants' keys at their defaults: what a config.yaml of one flat class wrote
        for name, value in data.items():
            if name not in names and self._at_default(name, value):
                legacy.append(name)
            elif name not in names:
                raise ConfigError(self._unknown(f"{under}{name}", value, tag, names, origin))
        if legacy:
            logger.warning(
                "%s: %d keys of other %ss at their defaults dropped from %s %s (%s): a config written before "
                "each %s had its own keys",
                origin(key),
                len(legacy),
                self.tag,
                self.tag,
                tag,
                ", ".join(legacy),
                self.tag,
            )
            data = {k: v for k, v in data.items() if k not in legacy}
        try:
            return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(variant), {**data, self.tag: tag}))
        except OmegaConfBaseException as exc:
            raise explain(exc, variant, origin(f"{under}{getattr(exc, 'full_key', '')}"), under) from exc

    def _at_default(self, name: str, value: Any) -> bool:
        """Whether every variant that declares key ``name`` has ``value`` as its default."""
        defaults = [
            f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            for v in self.variants.values()
            for f in dataclasses.fields(v)
            if f.name == name and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
        ]
        return bool(defaults) and all(d == value for d in defaults)

    def _unknown(self, key: str, value: Any, tag: str, names: list[str], origin: Callable[[str], str]) -> str:
        """A key its variant does not declare: the variants that do, a close key of its own, and its keys."""
        name = key.rsplit(".", 1)[-1]
        others = [t for t, v in self.variants.items() if name in {f.name for f in dataclasses.fields(v)}]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" ('{name}' is a key of {self.tag}{'s' * (len(others) > 1)} {', '.join(others)})" if others else ""
        hint += f"; did you mean '{close[0]}'?" if close else ";"
        return (
            f"{origin(key)}: unknown config key '{key}' = {value!r} for a {self.what} of {self.tag} {tag}{hint} "
            f"keys of {self.tag} {tag}: {', '.join(names)}"
        )

    def field_type(self, name: str) -> Any:
        """The type the variants declare for key ``name`` (one type per name across variants), or None."""
        for variant in self.variants.values():
            hints = typing.get_type_hints(variant)
            if name in hints:
                return hints[name]
        return None

    def describe(self, key: str, value: Any) -> list[str]:
        """``--help``'s lines under the union's own, indented to read as part of it: every key of each variant in use
        in ``value`` (a built value or a list of them), and one line for each other variant with its own keys."""
        prefix = f"{key}[]." if isinstance(value, list) else f"{key}."
        used = dict.fromkeys(getattr(v, self.tag) for v in (value if isinstance(value, list) else [value]))
        keys = {tag: [f.name for f in dataclasses.fields(v)] for tag, v in self.variants.items()}
        common = [k for k in keys[next(iter(keys))] if all(k in names for names in keys.values())]
        lines = [
            f"    {self.tag}: one of {', '.join(self.variants)}; each has the keys {', '.join(common)} and its own:"
        ]
        for tag, variant in self.variants.items():
            about = (variant.__doc__ or "").strip().splitlines()[0]
            if tag in used:
                lines.append(f"    {self.tag} {tag} (in use): {about}")
                lines.extend("    " + line for line in describe(variant, prefix))
            else:
                lines.append(
                    f"    {self.tag} {tag}: {about} Keys: {', '.join(k for k in keys[tag] if k not in common)}"
                )
        return lines
