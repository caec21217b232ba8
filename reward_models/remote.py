"""Reward sources behind HTTP: the wire format of ``vlrft serve-reward-model`` and the one HTTP client of the
remote kinds (``http``, ``openai_judge``: ``reward_models.remote_sources``).

Wire format (JSON). ``POST /score`` takes ``{"samples": [SAMPLE, ...]}`` where a SAMPLE has the fields of
:class:`~reward_models.samples.Sample` (``id``, ``prompt``, ``response``; optional ``answer``, ``images``,
``task``, ``system``, ``metadata``, ``extra``) with each image a data URI (``data:image/png;base64,...``, what
:func:`~data_pipelines.images.png_data_uri` writes; paths on the server's own disk only if it allows them), and answers
the :class:`~reward_models.sources.Scores` of those samples: ``{"values": [...], "failed": {"INDEX": "why"},
"extras": {...}}``. ``POST /verify`` (a source that grades on its own) answers one
:class:`~reward_models.verifiers.VerifierResult` per sample, with its ``vote_key``. ``GET /health`` answers
``{"name", "kind", "holds_model", "grades", "needs", "requests", "calls", "auth"}`` (``needs``: the record fields the
source reads, which the client's preflight checks in every record; the last two: ``/score`` requests answered
and scoring calls made so far).

Values travel as JSON numbers: a float32 reward is written as the float64 that holds it exactly and read
back bit for bit. Replies are strict JSON (no NaN or Infinity): a sample whose value is not finite gets
``null`` and its entry in ``failed`` (``non-finite reward nan``), so the client's fallback and counts apply.
Images travel as lossless PNG, decoded on the server by :func:`~data_pipelines.images.load_image` (no resize):
a source sees the pixels it would see in-process.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

import httpx
import torch

from data_pipelines.images import png_data_uri
from reward_models.samples import Sample
from reward_models.sources import Scores
from reward_models.verifiers import VerifierResult

T = TypeVar("T")
R = TypeVar("R")
# a multi-turn trajectory (its PIL images) does not travel: a served source scores the last turn; nor do videos
# (local paths; a served source is refused video records before training: reward_models.sources.reads_videos)
SAMPLE_FIELDS = tuple(f.name for f in fields(Sample) if f.name not in ("trajectory", "videos"))
REQUIRED_FIELDS = ("id", "prompt", "response")
BACKOFF_S = 0.5  # the wait before retry k (k = 0, 1, ...) is BACKOFF_S * 2**k


# -- the wire format ------------------------------------------------------------------------------
def sample_json(sample: Sample, uris: dict[int, str] | None = None) -> dict[str, Any]:
    """A sample as JSON, its images inline as PNG data URIs (``uris``: already encoded images by ``id()``;
    the responses of one prompt share its images)."""
    uris = {} if uris is None else uris
    images = []
    for im in sample.images:
        if id(im) not in uris:
            uris[id(im)] = im if isinstance(im, str) and im.startswith("data:") else png_data_uri(im)
        images.append(uris[id(im)])
    out = {name: getattr(sample, name) for name in SAMPLE_FIELDS}
    out["images"] = images
    return out


def sample_from_json(obj: Any, where: str) -> Sample:
    """A :class:`Sample` from its JSON (``where``: e.g. ``samples[3]``, for the error), its images still data
    URIs or paths (the server reads them: ``reward_models.serve_requests``); ``ValueError`` naming the field that is
    wrong (a missing one, one of another JSON type, one that is not a field)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: want an object with the fields {', '.join(SAMPLE_FIELDS)}")
    unknown = sorted(set(obj) - set(SAMPLE_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; fields: {', '.join(SAMPLE_FIELDS)}")
    for name in REQUIRED_FIELDS:
        if not isinstance(obj.get(name), str):
            raise ValueError(f"{where}.{name}: want a string")
    for name in ("answer", "task", "system"):
        if obj.get(name) is not None and not isinstance(obj[name], str):
            raise ValueError(f"{where}.{name}: want a string or null, got {_json_type(obj[name])}")
    for name, typ in (("images", list), ("metadata", dict), ("extra", dict)):
        if not isinstance(obj.get(name, typ()), typ):
            raise ValueError(f"{where}.{name}: want a {typ.__name__}")
    for j, im in enumerate(obj.get("images", [])):
        if not isinstance(im, str):
            raise ValueError(f"{where}.images[{j}]: want a data URI or a path (a string), got {_json_type(im)}")
    return Sample(**{k: v for k, v in obj.items() if v is not None or k in ("answer", "system")})


def scores_json(scores: Scores) -> dict[str, Any]:
    """Scores as strict JSON (RFC 8259 has no NaN or Infinity): a non-finite value travels as null and fails its
    sample with the reason the pool gives in-process; a non-finite extra is left out."""
    values = [float(v) for v in scores.values.detach().float().cpu().reshape(-1).tolist()]
    failed = dict(scores.failed)
    for i, v in enumerate(values):
        if not math.isfinite(v):
            failed.setdefault(i, f"non-finite reward {v}")
    return {
        "values": [v if math.isfinite(v) else None for v in values],
        "failed": {str(i): failed[i] for i in sorted(failed)},
        "extras": {k: float(v) for k, v in scores.extras.items() if math.isfinite(float(v))},
    }


def scores_from_json(obj: Any, n: int) -> Scores:
    """The :class:`Scores` of ``n`` samples from a reply; ``ValueError`` naming what is wrong with it."""
    if not isinstance(obj, dict) or not isinstance(obj.get("values"), list):
        raise ValueError(f"want an object with 'values' (a list of {n} numbers), got {_shown(obj)}")
    values, failed, extras = obj["values"], obj.get("failed", {}), obj.get("extras", {})
    if len(values) != n or not all(isinstance(v, (int, float, type(None))) and not isinstance(v, bool) for v in values):
        raise ValueError(f"'values' must be {n} numbers, got {_shown(values)}")
    if not isinstance(failed, dict) or not all(k.isdigit() and int(k) < n for k in failed):
        raise ValueError(f"'failed' must map sample indices below {n} to reasons, got {_shown(failed)}")
    unexplained = [i for i, v in enumerate(values) if v is None and str(i) not in failed]
    if unexplained:
        raise ValueError(f"'values'[{unexplained[0]}] is null, but 'failed' does not say why")
    if not isinstance(extras, dict) or not all(isinstance(v, (int, float)) for v in extras.values()):
        raise ValueError(f"'extras' must map names to numbers, got {_shown(extras)}")
    return Scores(
        torch.tensor([0.0 if v is None else v for v in values], dtype=torch.float32),
        {int(k): str(why) for k, why in failed.items()},
        {k: float(v) for k, v in extras.items()},
    )


def result_json(result: VerifierResult, vote_key: str | None) -> dict[str, Any]:
    """A verifier's result as strict JSON: a non-finite score travels as 0, not correct, the reason as ``error``."""
    if not math.isfinite(result.score):
        result = VerifierResult(0.0, result.extracted, False, result.format_ok, f"non-finite score {result.score}")
    return {**asdict(result), "vote_key": vote_key}


def result_from_json(obj: Any) -> tuple[VerifierResult, str | None]:
    names = [f.name for f in fields(VerifierResult)]
    if not isinstance(obj, dict) or not set(names) - {"error"} <= set(obj):
        raise ValueError(f"want an object with {', '.join(names)}, got {_shown(obj)}")
    return VerifierResult(**{k: obj.get(k) for k in names}), obj.get("vote_key")


def check_url(url: str, key: str) -> str | None:
    """Why ``url`` is no HTTP address (None when it is one)."""
    if not url:
        return f"{key}: empty; want http://HOST:PORT"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is no number
    except ValueError as exc:
        return f"{key}={url}: {exc}; want http://HOST:PORT"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{key}={url}: want http://HOST:PORT or https://HOST[:PORT]"
    return None


def _json_type(value: Any) -> str:
    """The JSON name of ``value``'s type, for messages (``a list``, ``a number``)."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 120 else text[:117] + "..."


# -- the client -----------------------------------------------------------------------------------
@dataclass
class Reply:
    """A request's outcome: the reply's JSON, or why there is none (``timeout``: its last try timed out;
    ``unavailable``: the server did not answer it, refused it or answered 5xx on every try)."""

    data: Any = None
    error: str = ""
    timeout: bool = False
    unavailable: bool = False


class HttpClient:
    """JSON over HTTP with a time limit per try, ``max_retries`` retries with exponential backoff (timeouts,
    refused or broken connections and 5xx replies are retried; a 4xx reply or a reply that is not JSON is not),
    and up to ``max_concurrency`` requests in flight (:meth:`map`). Never raises for the server's failures:
    a :class:`Reply` says what happened, naming the URL."""

    def __init__(
        self, timeout_s: float, max_retries: int, max_concurrency: int, headers: dict[str, str] | None = None
    ) -> None:
        self.max_retries = max_retries
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self.http = httpx.Client(timeout=timeout_s, limits=limits, headers=headers or {}, trust_env=False)
        self.threads = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="http")
        self.timeout_s = timeout_s

    def request(self, method: str, url: str, payload: Any = None) -> Reply:
        tries = self.max_retries + 1
        for attempt in range(tries):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            retry, reply = self._try(method, url, payload)
            if not retry:
                return reply
        reply.error += f" (after {tries} tries)" if tries > 1 else ""
        reply.unavailable = True
        return reply

    def _try(self, method: str, url: str, payload: Any) -> tuple[bool, Reply]:
        """(worth retrying, the outcome) of one try."""
        try:
            body = None if payload is None else json.dumps(payload).encode()
            headers = {"content-type": "application/json"} if body is not None else {}
            r = self.http.request(method, url, content=body, headers=headers)
        except httpx.TimeoutException:
            return True, Reply(error=f"{url}: timed out after {self.timeout_s:g} s", timeout=True)
        except httpx.ConnectError as exc:
            return True, Reply(error=f"{url}: connection failed ({_reason(exc)})")
        except httpx.TransportError as exc:  # reset, closed mid-reply, protocol errors
            return True, Reply(error=f"{url}: {type(exc).__name__} ({_reason(exc)})")
        if r.status_code >= 400:
            return r.status_code >= 500, Reply(error=f"{url}: HTTP {r.status_code} {r.reason_phrase}: {_body(r)}")
        try:
            return False, Reply(r.json())
        except ValueError:
            return False, Reply(error=f"{url}: malformed reply (not JSON): {_body(r)}")

    def map(self, fn: Callable[[T], R], items: list[T]) -> list[R]:
        """``[fn(item) for item in items]``, ``max_concurrency`` at a time."""
        return list(self.threads.map(fn, items))

    def close(self) -> None:
        self.threads.shutdown(wait=True)
        self.http.close()


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return text.split("] ", 1)[-1] if text.startswith("[Errno") else text


def _body(r: httpx.Response) -> str:
    text = " ".join(r.text.split())
    return (text if len(text) <= 200 else text[:197] + "...") or "(empty body)"
