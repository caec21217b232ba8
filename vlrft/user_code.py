"""Code from the user's own files: reward functions, verifiers and tools named by a spec (one mechanism for all three).

A spec is ``path/to/file.py:name`` (a file, relative to the current directory) or ``package.module:name``
(importable). :func:`load_callable` imports it once per process and returns the callable;
:func:`where` names its file and line for messages; :func:`check_signature` says whether it accepts the
arguments it will be called with. Failures are :class:`~vlrft.config.ConfigError` naming the config key,
the spec and, for an import that raised, the file and line of the error; a file that is not Python is refused
unread, and an import that has not finished after ``VLRFT_IMPORT_TIMEOUT_S`` (120 s) is refused naming the file
(it runs in a thread, so that a module that hangs cannot hang preflight).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

from vlrft.config import ConfigError

_loaded: dict[str, Callable[..., Any]] = {}
IMPORT_TIMEOUT_S = 120.0  # importing on a busy 2-core machine can take a while (as a worker's start-up)


def is_spec(value: str) -> bool:
    """Whether ``value`` names user code (``file.py:name`` or ``module:name``) rather than a built-in name."""
    if ":" not in value:
        return False
    target, _, name = value.rpartition(":")
    return bool(target and name.isidentifier())


def _module(target: str, key: str, spec: str) -> Any:
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"{key}={spec}: no such file {path}")
        if path.suffix != ".py":
            raise ConfigError(f"{key}={spec}: {path} is not a Python file; want path/to/file.py:function")
        name = f"vlrft_user_{abs(hash(str(path)))}"
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            _within_time(lambda: loader_spec.loader.exec_module(module), path)
        except BaseException as exc:  # noqa: BLE001 - the user's import error, located
            sys.modules.pop(name, None)
            if isinstance(exc, _TooSlow):
                raise ConfigError(f"{key}={spec}: {exc}") from None
            raise ConfigError(f"{key}={spec}: importing {path} failed: {_located(exc, path)}") from exc
        return module
    try:
        return _within_time(lambda: importlib.import_module(target), target)
    except ModuleNotFoundError as exc:
        if Path(target).expanduser().is_file():  # data.json:fn, script.sh:fn
            raise ConfigError(
                f"{key}={spec}: {target} is a file but not a Python file; want path/to/file.py:function"
            ) from None
        raise ConfigError(
            f"{key}={spec}: no module {target!r} ({exc}); give a file path or an importable module"
        ) from exc
    except _TooSlow as exc:
        raise ConfigError(f"{key}={spec}: {exc}") from None
    except BaseException as exc:  # noqa: BLE001
        raise ConfigError(f"{key}={spec}: importing {target} failed: {_located(exc, None)}") from exc


class _TooSlow(Exception):
    """An import of the user's code that did not finish in time."""


def import_timeout_s() -> float:
    """How long importing the user's module may take (``VLRFT_IMPORT_TIMEOUT_S``, default 120 s)."""
    try:
        return float(os.environ.get("VLRFT_IMPORT_TIMEOUT_S", "") or IMPORT_TIMEOUT_S)
    except ValueError:
        raise ConfigError(f"VLRFT_IMPORT_TIMEOUT_S={os.environ['VLRFT_IMPORT_TIMEOUT_S']!r}: want seconds") from None


def _within_time(job: Callable[[], Any], what: Any) -> Any:
    """``job()`` (an import of the user's code) run in a thread for at most :func:`import_timeout_s` seconds: a
    module that hangs at import is a ConfigError naming it, not a preflight that never ends (the thread is left
    behind, a daemon)."""
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["value"] = job()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            done["error"] = exc

    limit = import_timeout_s()
    thread = threading.Thread(target=run, name="vlrft-import", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        raise _TooSlow(f"importing {what} did not finish within {limit:g} s (VLRFT_IMPORT_TIMEOUT_S)")
    if "error" in done:
        raise done["error"]
    return done["value"]


# Where Python and the installed libraries live, and vlrft's own packages: a frame there is not the user's line.
_NOT_USER = tuple(
    sorted(
        {str(Path(sysconfig.get_paths()[k]).resolve()) + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")}
        | {str(Path(__file__).resolve().parents[1] / p) + os.sep for p in ("vlrft", "reward_models", "data_pipelines")}
    )
)


def raised_at(exc: BaseException, path: str | Path | None = None) -> str:
    """``file:line: `` of the user's line where ``exc`` was raised: the innermost frame in ``path`` (the user's
    file) when given and on the traceback, else the innermost frame outside Python, the installed libraries and
    vlrft (a library's wrapper of ``sys.exit``, such as wandb's exit hook, or ``json.loads`` raising is not the
    user's line), else the innermost frame; ``""`` without a traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    if path is not None:
        path = Path(path).resolve()
        mine = [f for f in frames if Path(f.filename).resolve() == path]
    else:
        mine = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_NOT_USER)]
    at = (mine or frames)[-1:]
    return f"{at[0].filename}:{at[0].lineno}: " if at else ""


def _located(exc: BaseException, path: Path | None) -> str:
    """``file:line: Type: message`` of the user's line (:func:`raised_at`) in ``path`` (or anywhere)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}: SyntaxError: {exc.msg}"
    return f"{raised_at(exc, path)}{type(exc).__name__}: {exc}"


def source_file(fn: Callable[..., Any] | None) -> str | None:
    """The file ``fn`` is defined in (``None`` when unknown)."""
    try:
        return inspect.getsourcefile(fn) if fn is not None else None
    except TypeError:
        return None


def load_callable(spec: str, key: str) -> Callable[..., Any]:
    """The callable ``spec`` names (imported once per process); ``key`` names the config key in errors."""
    if spec in _loaded:
        return _loaded[spec]
    if not is_spec(spec):
        raise ConfigError(f"{key}={spec}: want path/to/file.py:function or package.module:function")
    target, _, name = spec.rpartition(":")
    module = _module(target, key, spec)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:8]
        raise ConfigError(f"{key}={spec}: {target} has no function {name!r} (callables there: {', '.join(found)})")
    _loaded[spec] = fn
    return fn


def where(fn: Callable[..., Any]) -> str:
    """``file:line`` of ``fn``'s definition (or its repr)."""
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return repr(fn)


def check_signature(
    fn: Callable[..., Any], spec: str, key: str, args: int, keywords: tuple[str, ...] = (), partial: bool = False
) -> None:
    """Refuse ``fn`` unless it accepts ``args`` positional arguments and the keyword arguments ``keywords``
    (``partial``: other required arguments may come later, e.g. a dataset's columns)."""
    try:
        sig = inspect.signature(fn)
        (sig.bind_partial if partial else sig.bind)(*range(args), **dict.fromkeys(keywords))
    except TypeError as exc:
        raise ConfigError(
            f"{key}={spec} ({where(fn)}): does not accept {args} positional argument(s)"
            + (f" and keyword arguments {', '.join(keywords)}" if keywords else "")
            + f" ({exc})"
        ) from None
    except ValueError:  # a builtin without a signature: accepted, called as documented
        pass
