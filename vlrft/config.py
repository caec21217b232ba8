"""Typed configs: nested dataclasses, YAML files, dotted command-line overrides, validated at start-up.

A config schema is a tree of dataclasses whose fields are declared with :func:`option`, which carries
the help text (shown by ``--help``) and, for string options with a fixed vocabulary, the allowed
values. :func:`load_config` merges defaults <- YAML file <- ``key.sub=value`` overrides with OmegaConf
structured configs, so unknown keys and wrong types are refused, and reports every problem as a
:class:`ConfigError` naming the source, the dotted key and what was expected.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value or key that cannot be accepted; the message names where and why."""


# range rules of numeric options: metadata key -> (test, how the rule reads in an error)
RANGES = {
    "gt": (lambda v, b: v > b, "> {}"),
    "ge": (lambda v, b: v >= b, ">= {}"),
    "lt": (lambda v, b: v < b, "< {}"),
    "le": (lambda v, b: v <= b, "<= {}"),
}


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    choices: Iterable | None = None,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    finite: bool = False,
    why: str = "",
    reads: bool = False,
    union: Any = None,
    **kwargs,
):
    """A dataclass field with help text, optional allowed values (a tuple, or a registry dict whose names
    are read when checked, so that one registered later is allowed) and an optional numeric range
    (``gt``/``ge``/``lt``/``le`` bounds; ``finite``: no NaN or infinity), all checked by :func:`load_config`.
    ``why`` ends the range error (``"for training"``). ``None`` values of optional fields pass. ``reads``: the
    value may name a file or folder the run reads (:func:`input_paths`; ``train.overwrite`` never clears it).
    ``union``: the field (typed ``Any``, or ``list[Any]`` for a list of them) holds one of several dataclasses
    chosen by a tag key (a :class:`vlrft.config_union.TaggedUnion`: the reward sources' ``kind``).

    Mutable defaults (lists, dicts, dataclass instances) are wrapped in a default factory.
    """
    metadata: dict[str, Any] = {"help": help}
    if reads:
        metadata["reads"] = True
    if union is not None:
        metadata["union"] = union
    if choices is not None:  # a registry (name -> entry) stays live: a name registered later is accepted
        metadata["choices"] = choices.keys() if isinstance(choices, Mapping) else tuple(choices)
    bounds = {k: v for k, v in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le)) if v is not None}
    if bounds or finite:
        metadata["range"] = bounds
        metadata["why"] = why
    if default is not dataclasses.MISSING and (isinstance(default, (list, dict)) or dataclasses.is_dataclass(default)):
        factory = lambda d=default: copy.deepcopy(d)  # noqa: E731
        return dataclasses.field(default_factory=factory, metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def _known_keys(schema: type, dotted: str) -> list[str]:
    node: Any = schema
    for part in [p for p in dotted.split(".") if p][:-1]:
        hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        node = hints.get(part)
        if node is None or not dataclasses.is_dataclass(node):
            return []
    return [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []


# keys that users may still have in YAML files, and what replaced them (an unknown key in this table is
# refused naming its replacement instead of with a did-you-mean)
REPLACED_KEYS = {
    "train.accuracy_source": "use reward.accuracy_source (the one accuracy knob: the pool's diagnostics and the "
    "training accuracy read it)",
    "data.synthetic_task": "use data.train_source=synthetic:TASK (and data.eval_source=synthetic:TASK)",
    "data.synthetic_seed": "use train.seed (synthetic training records are drawn with it, held-out ones with "
    "train.seed + 10000)",
}


def explain(exc: OmegaConfBaseException, schema: type, source: str, prefix: str = "") -> ConfigError:
    """OmegaConf's error on merging into ``schema`` as one line naming ``source`` and the dotted key (``prefix``:
    where ``schema`` sits in the whole config, e.g. ``reward.sources[0].``)."""
    key = getattr(exc, "full_key", None) or "?"
    if key in REPLACED_KEYS:
        return ConfigError(f"{source}: config key '{key}' is gone; {REPLACED_KEYS[key]}")
    known = _known_keys(schema, key)
    key = prefix + key
    if isinstance(exc, ConfigKeyError) or "not in" in str(exc):
        leaf = key.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(leaf, known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        where = key.rsplit(".", 1)[0] + "." if "." in key else ""
        return ConfigError(
            f"{source}: unknown config key '{key}'{hint} Known keys under '{where or '(top level)'}': "
            f"{', '.join(known)}"
        )
    if isinstance(exc, ValidationError):
        msg = str(exc).splitlines()[0]
        return ConfigError(f"{source}: bad value for config key '{key}': {msg}")
    return ConfigError(f"{source}: config key '{key}': {str(exc).splitlines()[0]}")


def range_rule(metadata: Any) -> str:
    """How a field's range reads (``"> 0"``, ``">= 0 and <= 1"``, ``"finite"``); empty without one."""
    bounds = metadata.get("range")
    if bounds is None:
        return ""
    return " and ".join(RANGES[k][1].format(v) for k, v in bounds.items()) or "finite"


def check_range(key: str, value: Any, metadata: Any) -> None:
    """Raise a :class:`ConfigError` naming ``key``, ``value`` and the rule when ``value`` breaks the
    field's range (NaN and infinities break every range, and the message says they are not finite)."""
    bounds = metadata.get("range")
    if bounds is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    finite = math.isfinite(value)
    if not finite or not all(RANGES[k][0](value, b) for k, b in bounds.items()):
        why = f" {metadata['why']}" if metadata.get("why") else ""
        rule = range_rule(metadata)
        said = "not finite; " if not finite and rule != "finite" else ""  # inf passes "> 0": say what is wrong
        raise ConfigError(f"{key}={value}: {said}must be {rule}{why}")


def _check_choices(obj: Any, prefix: str = "") -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(
                f"config key '{key}' = {value!r} is not allowed; choose one of: {', '.join(map(str, choices))}"
            )
        check_range(key, value, f.metadata)
        if dataclasses.is_dataclass(value):
            _check_choices(value, key + ".")
        if isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    _check_choices(item, f"{key}[{i}].")
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(f"config section '{prefix.rstrip('.') or '(top level)'}': {exc}") from exc


def load_config(
    schema: type[T], path: str | Path | list[str | Path] | None = None, overrides: list[str] | tuple = ()
) -> T:
    """Defaults of ``schema`` <- YAML at ``path`` (or several files, later ones winning) <- dotted
    ``key=value`` overrides, validated.

    Returns an instance of ``schema``. Raises :class:`ConfigError` naming the key, its source and
    what was expected for unknown keys, wrong types, disallowed values and failed ``validate()`` checks.
    Union fields (``option(union=...)``) merge as plain data and are built into their variants at the end.
    """
    cfg = _unions_as_data(OmegaConf.structured(schema), schema)
    origins: dict[str, str] = {}  # dotted key -> the file or override that set it last (the unions' errors)
    for path in [] if path is None else path if isinstance(path, (list, tuple)) else [path]:
        path = Path(path)
        if path.is_dir():
            names = sorted(p.name for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
            held = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            held = f"YAML files in it: {held}" if names else "it holds no YAML file"
            raise ConfigError(f"config file {path}: is a folder; a config must be a YAML file ({held})")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = OmegaConf.load(path)
        except Exception as exc:  # YAML syntax errors carry their line
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(loaded, type(OmegaConf.create({}))):
            raise ConfigError(f"{path}: the top level must be a mapping of config keys")
        content = OmegaConf.to_container(loaded)
        _check_sections(content, schema, str(path))
        try:
            cfg = OmegaConf.merge(cfg, loaded)
        except OmegaConfBaseException as exc:
            raise explain(exc, schema, str(path)) from exc
        origins.update(dict.fromkeys(dotted_keys(content), str(path)))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"command-line override {item!r} must look like key.sub=value")
        key, text = item.split("=", 1)
        origins[key.strip()] = f"command-line override {item!r}"
        typ = _field_type(schema, key.strip())
        if typ in TYPED_OVERRIDES:
            value = TYPED_OVERRIDES[typ](key.strip(), text)
            try:
                cfg = OmegaConf.merge(cfg, OmegaConf.create(_nested(key, value)))
            except OmegaConfBaseException as exc:
                raise explain(exc, schema, f"command-line override {item!r}") from exc
            continue
        try:  # a key inside a list or dict, or an Optional/list/dict field: read as YAML (OmegaConf)
            dotted = OmegaConf.from_dotlist([item])
            _check_sections(OmegaConf.to_container(dotted), schema, f"command-line override {item!r}")
            cfg = OmegaConf.merge(cfg, dotted)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - YAML errors too: the value is then read as a plain string
            try:
                cfg = _merge_plain_string(cfg, item)
            except OmegaConfBaseException:
                if isinstance(exc, OmegaConfBaseException):
                    raise explain(exc, schema, f"command-line override {item!r}") from exc
                raise ConfigError(f"command-line override {item!r}: {str(exc).splitlines()[0]}") from exc
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:  # e.g. a required value still missing
        raise explain(exc, schema, "config") from exc
    _build_unions(obj, origins)
    _check_choices(obj)
    return obj


def _unions_as_data(cfg: Any, schema: type, prefix: str = "") -> Any:
    """``cfg`` with every union field's default as plain data (its tag and the keys it sets), for OmegaConf
    to merge files and overrides into without a schema: a variant is chosen only once merging is done."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key, union = f"{prefix}{f.name}", f.metadata.get("union")
        if union is not None:
            node = OmegaConf.select(cfg, key)
            value = OmegaConf.to_object(node) if OmegaConf.is_config(node) else node
            OmegaConf.update(cfg, key, union.as_data(value), merge=False)
        elif dataclasses.is_dataclass(hints[f.name]):
            _unions_as_data(cfg, hints[f.name], key + ".")
    return cfg


def _build_unions(obj: Any, origins: dict[str, str], prefix: str = "") -> None:
    """Build, in place, each union field's merged data into its variant (``union.build``); an error names the
    file or override that set the key (``origins``, the nearest enclosing key that has one)."""

    def origin(key: str) -> str:
        parts = re.split(r"(?=[.[])", key)  # reward.sources[0].path -> reward, .sources, [0], .path
        found = (origins.get("".join(parts[:n])) for n in range(len(parts), 0, -1))
        return next((where for where in found if where), "config")

    for f in dataclasses.fields(obj):
        value, key, union = getattr(obj, f.name), f"{prefix}{f.name}", f.metadata.get("union")
        if union is not None and isinstance(value, list):
            setattr(obj, f.name, [union.build(item, f"{key}[{i}]", origin) for i, item in enumerate(value)])
        elif union is not None:
            setattr(obj, f.name, union.build(value, key, origin))
        elif dataclasses.is_dataclass(value):
            _build_unions(value, origins, key + ".")


def _check_sections(node: Any, schema: type, source: str, prefix: str = "") -> None:
    """A section (a dataclass field: ``model``, ``train``, ``rollout.vllm``) given anything but a mapping is
    refused naming its key; OmegaConf's merge error names none (``config key '?'``)."""
    hints = typing.get_type_hints(schema)
    for key, value in node.items():
        section = hints.get(key)
        if not dataclasses.is_dataclass(section):
            continue
        if not isinstance(value, dict):
            shown = "null" if value is None else f"{value!r} ({type(value).__name__})"
            keys = ", ".join(f.name for f in dataclasses.fields(section))
            raise ConfigError(
                f"{source}: config key '{prefix}{key}' = {shown}: must be a mapping of the section's keys ({keys})"
            )
        _check_sections(value, section, source, f"{prefix}{key}.")


def _nested(key: str, value: Any) -> dict:
    node: Any = value
    for part in reversed(key.strip().split(".")):
        node = {part: node}
    return node


def _merge_plain_string(cfg: Any, item: str) -> Any:
    """``key.sub=value`` with ``value`` taken as the literal string (a value such as
    ``{prompt} Answer with one word.`` is not YAML flow syntax but text)."""
    key, value = item.split("=", 1)
    return OmegaConf.merge(cfg, OmegaConf.create(_nested(key, value)))


def _field_type(schema: type, dotted: str) -> Any:
    """The declared type of the field at ``dotted`` (walking the dataclass sections; a key of a union value, such
    as ``source.path``, as its variants declare it), or ``None`` when the key is unknown or lies inside a list
    or dict (``reward.sources.0.weight``, ``data.synthetic_options.x``)."""
    node: Any = schema
    union = None
    for part in dotted.split("."):
        if union is not None:
            node, union = union.field_type(part), None
            continue
        if not dataclasses.is_dataclass(node):
            return None
        field = next((f for f in dataclasses.fields(node) if f.name == part), None)
        if field is None:
            return None
        node, union = typing.get_type_hints(node)[part], field.metadata.get("union")
    return node


# YAML 1.2 core schema: decimal integers (leading zeros are decimal, not octal), 0o / 0x; floats with an optional
# exponent, .inf / .nan; booleans true / false only (yes/no/on/off are text)
INT_12 = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")
FLOAT_12 = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
FLOAT_SPECIAL = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}
FLOAT_SPECIAL.update({k.replace(".", ""): v for k, v in FLOAT_SPECIAL.items()})  # Python's inf, -inf, nan


def _override_str(key: str, text: str) -> str:
    """The text as written (``no``, ``0612``, ``1e3`` stay text; empty is the empty string); a value wholly in
    one pair of quotes is the quoted text (``''``: the empty string), read as YAML reads a quoted scalar."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        try:
            quoted = yaml.safe_load(text)  # YAML's own unquoting (escapes included)
        except yaml.YAMLError:
            return text
        return quoted if isinstance(quoted, str) else text
    return text


def _override_int(key: str, text: str) -> int:
    t = text.strip()
    if not INT_12.fullmatch(t):
        raise ConfigError(f"command-line override '{key}={text}': config key '{key}' is an integer; {t!r} is not one")
    return int(t, 0) if t[:2] in ("0o", "0x") else int(t)


def _override_float(key: str, text: str) -> float:
    t = text.strip()
    if FLOAT_12.fullmatch(t):
        return float(t)
    if t.lower() in FLOAT_SPECIAL:
        return FLOAT_SPECIAL[t.lower()]
    raise ConfigError(f"command-line override '{key}={text}': config key '{key}' is a number; {t!r} is not one")


def _override_bool(key: str, text: str) -> bool:
    t = text.strip().lower()
    if t not in ("true", "false"):
        raise ConfigError(
            f"command-line override '{key}={text}': config key '{key}' is a boolean; want true or false "
            "(overrides are read as YAML 1.2: yes/no/on/off are not booleans)"
        )
    return t == "true"


# field type -> how an override of it is read (other types, e.g. Optional[float], lists and dicts: as YAML)
TYPED_OVERRIDES = {str: _override_str, int: _override_int, float: _override_float, bool: _override_bool}


def input_paths(cfg: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``(dotted key, value)`` of every non-empty field declared ``reads`` (a file or folder the run may read:
    model, data, critic and reward-model paths), list items included (``reward.sources[0].path``)."""
    found: list[tuple[str, str]] = []
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if f.metadata.get("reads") and isinstance(value, str) and value.strip():
            found.append((key, value))
        elif dataclasses.is_dataclass(value):
            found.extend(input_paths(value, key + "."))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    found.extend(input_paths(item, f"{key}[{i}]."))
    return found


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (what is written into every run folder)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Any, out_dir: str | Path, name: str = "config.yaml") -> Path:
    """Write the resolved config into ``out_dir/name`` and return the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(to_yaml(cfg))
    return path


def dotted_keys(node: Any, prefix: str = "") -> list[str]:
    """The dotted keys a mapping sets (a mapping under a key counts for the key and its children; a list is one
    value)."""
    keys = []
    for k, v in node.items() if isinstance(node, dict) else ():
        keys.append(prefix + str(k))
        keys.extend(dotted_keys(v, f"{prefix}{k}."))
    return keys
