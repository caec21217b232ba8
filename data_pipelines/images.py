"""Image loading for Qwen-VL: any image form in, an RGB ``PIL.Image`` at Qwen's factor-28 size out.

``load_image`` accepts a path (``str``/``Path``, relative to ``base_dir`` or absolute, ``file://``
allowed), raw bytes, a base64 data URI (``data:image/png;base64,...``), the dict a ``datasets`` Image
feature stores (``{"bytes": ..., "path": ...}``) or a PIL image. It applies the EXIF orientation,
converts RGBA/LA/P (onto white), L, 1, CMYK, I;16/I/F to RGB, refuses images whose stored size
exceeds ``max_image_pixels`` before decoding them (decompression bombs), detects truncated and corrupt
files, and resizes with Qwen2-VL's ``smart_resize`` (both sides multiples of 28, pixel count within
``[min_pixels, max_pixels]``). Every failure is a :class:`~data_pipelines.errors.DataError`.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from data_pipelines.errors import DataError

try:  # the PIL image processor's module imports without torchvision
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
except ImportError:  # older transformers keep it in the main module (torchvision-free there)
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

IMAGE_FACTOR = 28  # patch 14 x spatial merge 2: one LLM token per 28x28 pixels
DEFAULT_MIN_PIXELS = 4 * 28 * 28  # 3136: at least 4 image tokens
DEFAULT_MAX_PIXELS = 16 * 28 * 28  # 12544: at most 16 image tokens (the tiny models' bounds)
DEFAULT_MAX_IMAGE_PIXELS = 64_000_000  # stored width x height above which an image is refused unread


def load_image(
    src: Any,
    *,
    min_pixels: int | None = DEFAULT_MIN_PIXELS,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    base_dir: str | Path | None = None,
    factor: int = IMAGE_FACTOR,
) -> Image.Image:
    """Load ``src`` as an RGB image resized for Qwen-VL (no resize when ``max_pixels`` is None).

    ``factor`` is the model's pixels per LLM token side: 28 for Qwen2-VL/Qwen2.5-VL, 32 for Qwen3-VL.
    """
    if isinstance(src, Image.Image):
        im = _decode(src, "image", max_image_pixels)
    else:
        im = _decode(*_open(src, base_dir), max_image_pixels)
    im = _to_rgb(im)
    if max_pixels is not None:
        im = resize_for_qwen(im, min_pixels=min_pixels or 0, max_pixels=max_pixels, factor=factor)
    return im


def open_image(src: Any, *, base_dir: str | Path | None = None) -> Image.Image:
    """``src`` (any form :func:`load_image` takes but a PIL image) opened lazily: its header read (format, size),
    its pixels not yet decoded, so that a caller can weigh ``size`` before paying for the decoding; ``load_image``
    of the result decodes it. A :class:`DataError` as ``load_image`` raises one."""
    return _open(src, base_dir)[0]


def _open(src: Any, base_dir: str | Path | None) -> tuple[Image.Image, str]:
    data, label = _read_bytes(src, base_dir)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit applies
            return Image.open(io.BytesIO(data)), label
    except Image.DecompressionBombError as exc:
        raise DataError(f"image too large, refused before decoding ({exc})", category="image too large") from exc
    except Exception as exc:  # noqa: BLE001 - PIL's plugins raise many types on garbage
        raise DataError(f"not a readable image: {label} ({_short(exc)})", category="corrupt image") from exc


def png_data_uri(image: Any) -> str:
    """``image`` as a PNG data URI, at its stored size: a PIL image as it is (PNG is lossless, so
    :func:`load_image` reads the same pixels back), any other form first read by :func:`load_image` (no resize).
    How images travel inline (``vlrft serve-reward-model``, OpenAI-compatible judges, HTML reports)."""
    im = image if isinstance(image, Image.Image) else load_image(image, max_pixels=None)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def qwen_size(
    size: tuple[int, int],
    *,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    factor: int = IMAGE_FACTOR,
) -> tuple[int, int]:
    """``(width, height)`` an image of ``size`` is resized to: transformers' ``smart_resize`` (sides multiples of
    ``factor``, pixels within bounds), what the Qwen-VL processors do and what the model sees."""
    width, height = size
    try:
        h, w = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError as exc:  # aspect ratio over 200
        raise DataError(f"bad image shape {width}x{height}: {exc}", category="bad image size") from exc
    return w, h


def resize_for_qwen(
    im: Image.Image,
    *,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    factor: int = IMAGE_FACTOR,
) -> Image.Image:
    """Resize to :func:`qwen_size`."""
    w, h = qwen_size(im.size, min_pixels=min_pixels, max_pixels=max_pixels, factor=factor)
    return im if (w, h) == im.size else im.resize((w, h), Image.Resampling.BICUBIC)


def image_bounds(processor: Any) -> dict[str, int]:
    """``min_pixels``, ``max_pixels`` and ``image_factor`` of a Qwen-VL processor (for ``read_records``)."""
    ip = getattr(processor, "image_processor", processor)
    size = getattr(ip, "size", None) or {}
    lo = size.get("shortest_edge", getattr(ip, "min_pixels", None))
    hi = size.get("longest_edge", getattr(ip, "max_pixels", None))
    if lo is None or hi is None:
        raise ValueError(f"{type(ip).__name__} has no Qwen-VL pixel bounds (size shortest_edge/longest_edge)")
    return {"min_pixels": int(lo), "max_pixels": int(hi), "image_factor": int(ip.patch_size * ip.merge_size)}


def local_file(src: str | Path, base_dir: str | Path | None = None) -> Path:
    """The file a path names (``file://`` and ``~`` allowed; relative to ``base_dir`` when given), which must exist:
    else a ``DataError`` (``is a directory`` / ``file not found``, category ``missing file``). Images, videos and
    video frames are found through it."""
    path = Path(str(src).removeprefix("file://")).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise DataError(f"{'is a directory' if path.is_dir() else 'file not found'}: {path}", category="missing file")
    return path


def _read_bytes(src: Any, base_dir: str | Path | None) -> tuple[bytes, str]:
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        if not data:
            raise DataError("empty image bytes (0 bytes)", category="empty file")
        return data, f"<{len(data)} bytes>"
    if isinstance(src, dict):  # a `datasets` Image feature: bytes win over path
        if src.get("bytes") is not None:
            return _read_bytes(src["bytes"], base_dir)
        if src.get("path"):
            return _read_bytes(src["path"], base_dir)
        raise DataError(f"image dict has neither 'bytes' nor 'path' (keys {sorted(src)})", category="wrong type")
    if isinstance(src, str) and src.startswith("data:"):
        return _decode_data_uri(src), "<data URI>"
    if isinstance(src, str) and src.startswith(("http://", "https://")):
        raise DataError(
            f"image URLs are not fetched (offline): {src[:80]}; download it and give its path",
            category="unsupported image",
        )
    if isinstance(src, (str, Path)):
        text = str(src)
        if not text.strip():
            raise DataError("empty image path", category="missing file")
        path = local_file(text, base_dir)
        data = path.read_bytes()
        if not data:
            raise DataError(f"empty file (0 bytes): {path}", category="empty file")
        return data, str(path)
    raise DataError(
        f"wrong type for an image: {type(src).__name__} (want a path, bytes, data URI, "
        "{'bytes','path'} dict or PIL image)",
        category="wrong type",
    )


def _decode_data_uri(uri: str) -> bytes:
    header, comma, payload = uri.partition(",")
    if not comma or ";base64" not in header:
        raise DataError(f"data URI is not base64-encoded: {uri[:40]}...", category="bad base64")
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise DataError(f"bad base64 in data URI ({exc})", category="bad base64") from exc
    if not data:
        raise DataError("empty data URI (0 bytes)", category="empty file")
    return data


def _decode(im: Image.Image, label: str, max_image_pixels: int) -> Image.Image:
    fmt = im.format or "image"
    w, h = im.size
    if w * h > max_image_pixels:
        raise DataError(
            f"image too large: {w}x{h} = {w * h} pixels > max_image_pixels {max_image_pixels} "
            f"(possible decompression bomb): {label}",
            category="image too large",
        )
    if w == 0 or h == 0:
        raise DataError(f"image has zero size {w}x{h}: {label}", category="bad image size")
    try:
        im.load()
    except Exception as exc:  # noqa: BLE001 - PIL's decoders raise OSError, SyntaxError, EOFError ...
        truncated = "truncat" in str(exc).lower() or isinstance(exc, EOFError)
        what = "truncated" if truncated else "corrupt"
        raise DataError(f"{what} {fmt} ({_short(exc)}): {label}", category=f"{what} image") from exc
    try:
        im = ImageOps.exif_transpose(im)
    except Exception:  # noqa: BLE001 - a broken EXIF block leaves the pixels as stored
        pass
    return im


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode == "RGB":
        return im
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        out = Image.new("RGB", im.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    if im.mode.startswith("I") or im.mode == "F":  # 16/32-bit integer or float grayscale
        arr = np.asarray(im).astype(np.float64)
        if im.mode.startswith("I;16") or (im.mode == "I" and arr.max(initial=0) > 255):
            arr = arr / 257.0  # 16-bit range to 8-bit
        return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), "L").convert("RGB")
    return im.convert("RGB")  # L, 1, P, CMYK, YCbCr, LAB, HSV


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."
