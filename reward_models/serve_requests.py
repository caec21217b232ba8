"""What a request to ``vlrft serve-reward-model`` holds, read within the server's bounds (:class:`Limits`).

- The body: at most ``max_request_mib`` (``413``), and no more than ``read_timeout_s`` between two of its bytes;
  a client that stalls mid-body, or leaves, is dropped with one line on the server's stderr (no traceback).
- The samples: the wire format's fields and JSON types (``reward_models.remote.sample_from_json``); anything
  else, a body nested too deeply included, is ``400`` with one line naming the field.
- The images: data URIs, or (``image_root`` set) paths under that folder: resolved (symlinks followed) they must
  stay inside it and name a regular file (no fifo, device or ``/proc`` file); a request's files are read up to
  ``max_request_mib`` in all (what its images could weigh inline); every way of failing that is the same reply,
  which quotes nothing of the file and says nothing of whether it exists. Each distinct image of a request is
  opened once (its header: format and size); only for a source that reads images (``RewardSource.reads_images``)
  are they decoded, and only when their pixels (width x height, summed over the request's distinct images) are
  at most ``max_request_pixels``: otherwise ``413`` naming both figures, before anything is decoded.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from PIL import Image

from data_pipelines.images import load_image, open_image
from reward_models.remote import sample_from_json
from reward_models.samples import Sample

MAX_REQUEST_MIB = 256  # images travel inline (aiohttp's default limit, 1 MiB, holds a few); --max-request-mib
MAX_REQUEST_PIXELS = 100_000_000  # decoded RGB: 300 MB a request; --max-request-pixels
READ_TIMEOUT_S = 30.0  # --read-timeout
SPECIAL_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))  # kernel files: regular to stat, never images


@dataclass(frozen=True)
class Limits:
    """The server's bounds on one request (the options of ``vlrft serve-reward-model`` of the same names)."""

    max_request_mib: int = MAX_REQUEST_MIB
    read_timeout_s: float = READ_TIMEOUT_S
    max_request_pixels: int = MAX_REQUEST_PIXELS
    image_root: Path | None = None  # resolved; None: images inline only

    @property
    def max_bytes(self) -> int:
        return self.max_request_mib << 20


async def read_samples(
    request: web.Request, limits: Limits, reads_images: bool, executor: Executor
) -> tuple[list[Sample | None], dict[int, str]]:
    """The request's samples (None where one's image failed, with why in the dict), their images decoded when
    ``reads_images`` (else opened only); an ``HTTPException`` for a request the server refuses."""
    loop = asyncio.get_running_loop()
    body = await loop.run_in_executor(executor, _parse, await _body(request, limits))
    if not isinstance(body, dict) or not isinstance(body.get("samples"), list):
        raise web.HTTPBadRequest(text='want {"samples": [...]}')
    samples = []
    for i, obj in enumerate(body["samples"]):
        try:
            sample = sample_from_json(obj, f"samples[{i}]")
        except ValueError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
        for j, im in enumerate(sample.images):
            if limits.image_root is None and not im.startswith("data:"):
                why = f"samples[{i}].images[{j}]: not a data URI; this server reads no files of its own disk"
                raise web.HTTPBadRequest(text=why + " (serve-reward-model --image-root DIR reads them)")
        samples.append(sample)
    distinct = list(dict.fromkeys(im for s in samples for im in s.images))  # the responses of a prompt share them
    opened = dict(zip(distinct, await _each(executor, _open, distinct, limits, _Budget(limits.max_bytes))))
    if reads_images:
        sizes = [im.size for im in opened.values() if isinstance(im, Image.Image)]
        pixels = sum(w * h for w, h in sizes)
        if pixels > limits.max_request_pixels:
            why = (
                f"the request's {len(sizes)} images hold {pixels:,} pixels (width x height, summed over distinct "
                f"images) > --max-request-pixels {limits.max_request_pixels:,}; send fewer samples per request "
                "(the source's http_batch_size) or smaller images"
            )
            raise web.HTTPRequestEntityTooLarge(limits.max_request_pixels, pixels, text=why)
        ready = [text for text, im in opened.items() if isinstance(im, Image.Image)]
        opened.update(zip(ready, await _each(executor, _decode, [opened[t] for t in ready])))
    failed = {}
    for i, sample in enumerate(samples):
        whys = [_failure(i, j, im, opened[im]) for j, im in enumerate(sample.images)]
        if any(whys):
            samples[i], failed[i] = None, next(w for w in whys if w)
        else:
            sample.images = [opened[im] for im in sample.images]
    return samples, failed


async def _body(request: web.Request, limits: Limits) -> bytes:
    """The body, read chunk by chunk, each within ``read_timeout_s``, at most ``max_bytes`` in all."""
    size, chunks, expected = 0, [], request.content_length
    if expected is not None and expected > limits.max_bytes:
        raise web.HTTPRequestEntityTooLarge(limits.max_bytes, expected, text=_too_long(limits))
    while True:
        try:
            chunk = await asyncio.wait_for(request.content.readany(), limits.read_timeout_s)
        except asyncio.TimeoutError:
            _drop(request, f"no byte for {limits.read_timeout_s:g} s (--read-timeout)", size, expected)
        except ConnectionError:
            _drop(request, "the client closed the connection", size, expected)
        except HttpProcessingError as exc:  # a malformed chunked body
            raise web.HTTPBadRequest(text=f"the body is malformed: {exc.message}") from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limits.max_bytes:
            raise web.HTTPRequestEntityTooLarge(limits.max_bytes, size, text=_too_long(limits))
        chunks.append(chunk)


def _too_long(limits: Limits) -> str:
    return f"the body is over --max-request-mib {limits.max_request_mib} ({limits.max_bytes:,} bytes)"


def _drop(request: web.Request, why: str, size: int, expected: int | None) -> NoReturn:
    """One line on stderr, the connection closed (the rest of the body is not waited for), the handler ended."""
    of = f" of {expected:,}" if expected is not None else ""
    print(f"dropped a request from {request.remote}: {why} after {size:,}{of} body bytes", file=sys.stderr, flush=True)
    request.protocol.force_close()
    raise web.HTTPRequestTimeout(text=why)  # (the connection is closed: no one reads it)


def _parse(body: bytes) -> Any:
    try:
        return json.loads(body)
    except RecursionError:
        limit = sys.getrecursionlimit()
        raise web.HTTPBadRequest(text=f"the body is JSON nested deeper than this server reads (about {limit} levels)")
    except ValueError as exc:
        raise web.HTTPBadRequest(text=f"the body is not JSON: {exc}") from None


async def _each(executor: Executor, fn: Any, items: list[Any], *args: Any) -> list[Any]:
    loop = asyncio.get_running_loop()
    return await asyncio.gather(*(loop.run_in_executor(executor, fn, item, *args) for item in items))


class _Unreadable(Exception):
    """A local image that is not served, whatever the reason (the reply does not say which)."""


class _Budget:
    """The bytes a request's image files may still take (threads read them concurrently)."""

    def __init__(self, n: int):
        self.left, self.lock = n, threading.Lock()

    def take(self, n: int) -> bool:
        with self.lock:
            if n > self.left:
                return False
            self.left -= n
            return True


def _open(text: str, limits: Limits, budget: _Budget) -> Image.Image | Exception:
    """The image opened (header read, pixels not decoded), or why not."""
    try:
        return open_image(text if text.startswith("data:") else _read_local(text, limits.image_root, budget))
    except _Unreadable as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - DataError and friends: the samples with this image fail
        return _Unreadable() if not text.startswith("data:") else exc


def _decode(im: Image.Image) -> Image.Image | Exception:
    try:
        return load_image(im, max_pixels=None)  # at the stored size: the source's own processor resizes
    except Exception as exc:  # noqa: BLE001 - as in _open
        return exc


def _read_local(text: str, root: Path, budget: _Budget) -> bytes:
    """The bytes of the file ``text`` names under ``root`` (relative to it, or absolute inside it)."""
    try:
        path = (root / text.removeprefix("file://")).resolve()
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop
        raise _Unreadable() from None
    if not path.is_relative_to(root) or any(path.is_relative_to(r) for r in SPECIAL_ROOTS):
        raise _Unreadable()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)  # a fifo does not block
    except OSError:
        raise _Unreadable() from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size <= 0 or not budget.take(st.st_size):
            raise _Unreadable()
        data = f.read(st.st_size + 1)
    if len(data) > st.st_size:  # it grew since
        raise _Unreadable()
    return data


def _failure(i: int, j: int, text: str, got: Any) -> str:
    """Why sample ``i`` fails on its image ``j`` ("" when it does not)."""
    if isinstance(got, _Unreadable):
        return f"samples[{i}].images[{j}]: not a readable image (a regular image file under the server's image root)"
    return f"samples[{i}]: {got}" if isinstance(got, Exception) else ""
