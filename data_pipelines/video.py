"""Video for Qwen-VL without torchvision: decode with PyAV, sample and resize by Qwen's rules, patchify with numpy.

A video is a file PyAV reads (mp4, webm, mkv, gif, ...) or a list of frame images (paths or any form
:func:`~data_pipelines.images.load_image` takes). What happens to it follows qwen-vl-utils' ``fetch_video``
(``vision_process.py``, the reference the Qwen model cards use), then the transformers video processors:

1. frames: :func:`sample_indices` (qwen-vl-utils' ``smart_nframes``): ``duration * fps`` frames, at least
   ``min_frames``, at most ``max_frames`` and the video's own count, rounded down to the temporal patch (2), taken at
   ``linspace(0, total - 1, n).round()``. A frame list is taken whole (an odd count padded with its last frame, as
   qwen-vl-utils does) as a video already sampled at ``fps``; over ``max_frames`` it is sampled down the same way.
2. size: :func:`frame_size`: each frame within ``[min_pixels, max_pixels]``, where ``max_pixels`` is also capped by
   an even share of the video's ``total_pixels`` budget (``total_pixels / frames * 2``, floored at
   ``1.05 * min_pixels``), sides multiples of ``patch_size * merge_size`` (transformers' ``smart_resize``, the one
   the image path uses); frames resized with PIL bicubic, as images are.
3. pixels: :func:`patchify`, transformers' ``Qwen2VLVideoProcessor.patchify`` (shared by Qwen2.5-VL and Qwen3-VL)
   in numpy: ``pixel_values_videos`` of ``grid_t * grid_h * grid_w`` rows of ``3 * 2 * patch * patch`` values and
   ``video_grid_thw = [frames / 2, height / patch, width / patch]``.

Timing: Qwen2.5-VL takes ``second_per_grid_ts = temporal_patch / sample_fps`` (:attr:`Video.second_per_grid`);
Qwen3-VL writes ``<{t:.1f} seconds>`` before each temporal grid's tokens in the prompt (:func:`grid_timestamps`;
the Qwen3-VL processor does it when :class:`QwenVideoProcessor` is its video processor). Decoding is lazy
(:func:`iter_frames`): frames are decoded in order and only the sampled ones are kept. Every failure is a
:class:`~data_pipelines.errors.DataError` naming the file.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import av
import numpy as np
from PIL import Image
from transformers.feature_extraction_utils import BatchFeature
from transformers.video_utils import VideoMetadata, make_batched_videos

from data_pipelines.errors import DataError
from data_pipelines.images import load_image, local_file, qwen_size

VIDEO_FPS = 2.0  # qwen-vl-utils' FPS
FRAME_FACTOR = 2  # the temporal patch: frames are sampled in pairs
VIDEO_MIN_FRAMES = 4  # qwen-vl-utils' FPS_MIN_FRAMES
VIDEO_MAX_FRAMES = 768  # qwen-vl-utils' FPS_MAX_FRAMES
VIDEO_MIN_TOKENS = 128  # per frame, qwen-vl-utils' VIDEO_MIN_TOKEN_NUM
VIDEO_MAX_TOKENS = 768  # per frame, qwen-vl-utils' VIDEO_MAX_TOKEN_NUM
VIDEO_TOTAL_TOKENS = int(128000 * 0.9)  # the whole video: 90% of qwen-vl-utils' MODEL_SEQ_LEN


@dataclass(frozen=True)
class VideoSettings:
    """How a video is sampled and sized (the module doc): frames per second, the frame-count bounds, and the pixel
    bounds per frame and for the whole video (``None``: qwen-vl-utils' defaults). The one list of these settings:
    :func:`load_video` and :class:`QwenVideoProcessor` take them as keywords (an unknown one is a ``TypeError``)."""

    fps: float = VIDEO_FPS
    min_frames: int = VIDEO_MIN_FRAMES
    max_frames: int = VIDEO_MAX_FRAMES
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None


SETTINGS = tuple(f.name for f in fields(VideoSettings))


@dataclass(frozen=True)
class VideoInfo:
    """What a video file's header and packet index say, before any frame is decoded."""

    path: str
    total_frames: int
    fps: float
    width: int
    height: int

    @property
    def duration(self) -> float:
        return self.total_frames / self.fps


@dataclass
class Video:
    """A sampled, resized video: ``frames`` (RGB, all of one size), which source ``indices`` they are, the source's
    ``fps`` and ``total_frames`` (for a frame list: ``fps`` is the rate it was given at)."""

    frames: list[Image.Image]
    indices: list[int]
    fps: float
    total_frames: int
    source: str

    @property
    def sample_fps(self) -> float:
        """Frames per second of the sample (transformers' ``VideoMetadata.sampled_fps``)."""
        return len(self.indices) / self.total_frames * self.fps

    @property
    def second_per_grid(self) -> float:
        """Qwen2.5-VL's ``second_per_grid_ts`` entry: seconds one temporal grid (2 frames) spans."""
        return FRAME_FACTOR / self.sample_fps


def sample_indices(
    total_frames: int,
    video_fps: float,
    *,
    fps: float = VIDEO_FPS,
    min_frames: int = VIDEO_MIN_FRAMES,
    max_frames: int = VIDEO_MAX_FRAMES,
) -> list[int]:
    """The frame indices Qwen samples (qwen-vl-utils' ``smart_nframes`` then ``linspace(0, total - 1, n).round()``).

    ``n = floor2(min(max(total / video_fps * fps, ceil2(min_frames)), floor2(min(max_frames, total)), total))``;
    ``ValueError`` when ``n < 2`` (a video of fewer than 2 frames, or ``max_frames < 2``)."""
    lo = math.ceil(min_frames / FRAME_FACTOR) * FRAME_FACTOR
    hi = math.floor(min(max_frames, total_frames) / FRAME_FACTOR) * FRAME_FACTOR
    wanted = total_frames / video_fps * fps
    n = math.floor(min(max(wanted, lo), hi, total_frames) / FRAME_FACTOR) * FRAME_FACTOR
    if n < FRAME_FACTOR:
        raise ValueError(
            f"{total_frames} frame(s) at max_frames {max_frames} give {n} sampled frames; Qwen-VL needs at least "
            f"{FRAME_FACTOR}"
        )
    return np.linspace(0, total_frames - 1, n).round().astype(int).tolist()


def frame_size(
    height: int,
    width: int,
    num_frames: int,
    *,
    factor: int,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    total_pixels: int | None = None,
) -> tuple[int, int]:
    """``(height, width)`` every frame is resized to (qwen-vl-utils' ``fetch_video``): ``min_pixels`` (default 128
    tokens of ``factor``-pixel sides), ``max_pixels`` capped by ``max(min(768 tokens, total_pixels / num_frames * 2),
    1.05 * min_pixels)``, ``total_pixels`` defaulting to 90% of a 128k-token context."""
    min_pixels = VIDEO_MIN_TOKENS * factor * factor if min_pixels is None else min_pixels
    total_pixels = VIDEO_TOTAL_TOKENS * factor * factor if total_pixels is None else total_pixels
    cap = max(min(VIDEO_MAX_TOKENS * factor * factor, total_pixels / num_frames * FRAME_FACTOR), int(min_pixels * 1.05))
    cap = int(cap if max_pixels is None else min(max_pixels, cap))
    w, h = qwen_size((width, height), min_pixels=min_pixels, max_pixels=cap, factor=factor)
    return h, w


def probe_video(src: str | Path, *, base_dir: str | Path | None = None) -> VideoInfo:
    """Read a video file's header (and, when the header has no frame count, its packet index; no frame decoded)."""
    path = _video_path(src, base_dir)
    with _open(path) as container:
        stream = container.streams.video[0]
        total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        rate = stream.average_rate or stream.guessed_rate
        if not rate and stream.duration and stream.time_base:
            rate = total / float(stream.duration * stream.time_base)
        width, height = stream.codec_context.width, stream.codec_context.height
    if total == 0:
        raise DataError(f"video has no frames: {path}", category="empty video")
    if not rate:
        raise DataError(f"video has no frame rate in its header: {path}", category="corrupt video")
    return VideoInfo(str(path), int(total), float(rate), int(width), int(height))


def iter_frames(
    src: str | Path, indices: Sequence[int], *, base_dir: str | Path | None = None
) -> Iterator[Image.Image]:
    """The frames at ``indices`` (sorted, repeats allowed) as RGB images, decoded in order and converted only when
    wanted; the file is closed once the last wanted frame is out. A video that ends first is a ``DataError``."""
    path = _video_path(src, base_dir)
    wanted = sorted(indices)
    if not wanted:
        return
    k, seen = 0, -1
    with _open(path) as container:
        try:
            for seen, frame in enumerate(container.decode(container.streams.video[0])):
                if seen == wanted[k]:
                    image = frame.to_image()
                    while k < len(wanted) and wanted[k] == seen:
                        yield image
                        k += 1
                    if k == len(wanted):
                        return
        except av.error.FFmpegError as exc:
            raise DataError(f"corrupt video at frame {seen + 1} ({exc}): {path}", category="corrupt video") from exc
    raise DataError(
        f"video ended after {seen + 1} frames, frame {wanted[k]} was wanted (truncated?): {path}",
        category="truncated video",
    )


@dataclass(frozen=True)
class VideoPlan:
    """What :func:`load_video` will make of a video, known from its header alone: the source ``indices`` sampled,
    the source ``fps`` and ``total_frames``, and the ``height`` x ``width`` every frame is resized to (enough to
    count the video's tokens: :func:`counting_videos`)."""

    indices: list[int]
    fps: float
    total_frames: int
    height: int
    width: int
    source: str


def plan_video(src: Any, *, factor: int, base_dir: str | Path | None = None, **settings: Any) -> VideoPlan:
    """The :class:`VideoPlan` of a video file (its header read, no frame decoded) or a frame list (its frames read
    for their size); failures as :func:`load_video`'s."""
    cfg = VideoSettings(**settings)
    if isinstance(src, (list, tuple)):
        video = _load_frame_list(src, factor, cfg, base_dir)
        w, h = video.frames[0].size
        return VideoPlan(video.indices, video.fps, video.total_frames, h, w, video.source)
    info = probe_video(src, base_dir=base_dir)
    try:
        indices = sample_indices(
            info.total_frames, info.fps, fps=cfg.fps, min_frames=cfg.min_frames, max_frames=cfg.max_frames
        )
    except ValueError as exc:
        raise DataError(f"{exc}: {info.path}", category="too few frames") from None
    h, w = _sized(info.height, info.width, len(indices), factor, cfg)
    return VideoPlan(indices, info.fps, info.total_frames, h, w, info.path)


def load_video(src: Any, *, factor: int, base_dir: str | Path | None = None, **settings: Any) -> Video:
    """A video file or a list of frame images, sampled and resized for Qwen-VL (see the module doc); ``factor``
    is ``patch_size * merge_size`` (28 for Qwen2-VL/Qwen2.5-VL, 32 for Qwen3-VL); ``settings``: those of
    :class:`VideoSettings`."""
    if isinstance(src, (list, tuple)):
        return _load_frame_list(src, factor, VideoSettings(**settings), base_dir)
    plan = plan_video(src, factor=factor, base_dir=base_dir, **settings)
    frames = [_resized(im, plan.width, plan.height) for im in iter_frames(plan.source, plan.indices)]
    return Video(frames, plan.indices, plan.fps, plan.total_frames, plan.source)


def checked_video(src: Any, *, base_dir: str | Path | None = None) -> Any:
    """A record's video as the readers keep it: a file's absolute path once its header says it has a video stream
    with frames and a frame rate (:func:`probe_video`; nothing decoded), or a frame list with each path made
    absolute (the frames are read when the video is encoded). Failures are ``DataError`` naming the file."""
    if isinstance(src, (list, tuple)):
        if not src:
            raise DataError("video frame list is empty", category="empty video")
        return [str(_frame_path(f, base_dir)) if isinstance(f, (str, Path)) else f for f in src]
    return probe_video(src, base_dir=base_dir).path


def _frame_path(src: str | Path, base_dir: str | Path | None) -> Path | str:
    """A frame's file (:func:`~data_pipelines.images.local_file`); a URL or data URI is left to ``load_image``."""
    text = str(src)
    return text if text.startswith(("http://", "https://", "data:")) else local_file(text, base_dir)


def _sized(height: int, width: int, n: int, factor: int, cfg: VideoSettings) -> tuple[int, int]:
    return frame_size(
        height,
        width,
        n,
        factor=factor,
        min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels,
        total_pixels=cfg.total_pixels,
    )


def _load_frame_list(frames, factor: int, cfg: VideoSettings, base_dir) -> Video:
    if not frames:
        raise DataError("video frame list is empty", category="empty video")
    indices = list(range(len(frames)))
    if len(frames) > cfg.max_frames:
        indices = sample_indices(len(frames), cfg.fps, fps=cfg.fps, max_frames=cfg.max_frames)
    indices += indices[-1:] * (len(indices) % FRAME_FACTOR)  # qwen-vl-utils pads an odd list with its last frame
    images = {i: load_image(frames[i], max_pixels=None, base_dir=base_dir) for i in sorted(set(indices))}
    sizes = {im.size for im in images.values()}
    label = str(frames[0]) if isinstance(frames[0], (str, Path)) else f"<{len(frames)} frames>"
    if len(sizes) > 1:
        raise DataError(f"video frames differ in size {sorted(sizes)}: {label}", category="bad video frames")
    (width, height), n = sizes.pop(), len(indices)
    h, w = _sized(height, width, n, factor, cfg)
    return Video([_resized(images[i], w, h) for i in indices], indices, cfg.fps, len(frames), label)


def patchify(frames: np.ndarray, *, patch_size: int, merge_size: int, temporal_patch_size: int) -> np.ndarray:
    """``[T, C, H, W]`` -> ``[T/tp * H/p * W/p, C * tp * p * p]`` in transformers' ``Qwen2VLVideoProcessor.patchify``
    order: rows by (temporal grid, merge block row, merge block column, row in block, column in block), each row
    (channel, frame in the temporal patch, pixel row, pixel column). An odd ``T`` is padded with the last frame."""
    if pad := -frames.shape[0] % temporal_patch_size:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    t, c, h, w = frames.shape
    gt, gh, gw, m, p = t // temporal_patch_size, h // patch_size, w // patch_size, merge_size, patch_size
    x = frames.reshape(gt, temporal_patch_size, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * temporal_patch_size * p * p)


def grid_timestamps(indices: Sequence[int], video_fps: float, temporal_patch_size: int = FRAME_FACTOR) -> list[float]:
    """Qwen3-VL's time of each temporal grid (transformers' ``Qwen3VLProcessor._calculate_timestamps``): the mean of
    its frames' ``index / video_fps``; the prompt has ``<{t:.1f} seconds>`` before each grid's frame tokens."""
    idx = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [i / video_fps for i in idx]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


class QwenVideoProcessor:
    """A transformers video processor for Qwen2-VL, Qwen2.5-VL and Qwen3-VL without torchvision.

    Called as the processor calls its ``video_processor``: ``videos`` in transformers' forms (a file path; a list of
    frame paths as ``[[path, ...]]``; decoded frames ``[T, H, W, C]``, with ``video_metadata`` for their timing),
    returns ``pixel_values_videos``, ``video_grid_thw`` and ``video_metadata`` (what Qwen2.5-VL's processor turns
    into ``second_per_grid_ts`` and Qwen3-VL's into timestamps). Settings are the module's (per call or as
    attributes); an unknown keyword with a value is a ``TypeError``, never ignored.
    """

    model_input_names = ["pixel_values_videos", "video_grid_thw"]
    settings = SETTINGS

    def __init__(
        self,
        *,
        patch_size: int,
        merge_size: int,
        temporal_patch_size: int,
        image_mean,
        image_std,
        rescale_factor: float = 1 / 255,
        base_dir: str | Path | None = None,
        **settings: Any,
    ) -> None:
        """``settings``: those of :class:`VideoSettings` (readable as attributes: ``processor.fps`` ...)."""
        self.patch_size, self.merge_size, self.temporal_patch_size = patch_size, merge_size, temporal_patch_size
        self.image_mean, self.image_std = np.asarray(image_mean, np.float64), np.asarray(image_std, np.float64)
        self.rescale_factor, self.base_dir = rescale_factor, base_dir
        self.video_settings = VideoSettings(**settings)
        self.counting = False  # True: videos are planned from their headers, not decoded (:func:`counting_videos`)

    def __getattr__(self, name: str) -> Any:  # processor.fps, processor.max_frames, ...: its settings
        if name in SETTINGS and "video_settings" in self.__dict__:
            return getattr(self.__dict__["video_settings"], name)
        raise AttributeError(name)

    @classmethod
    def like(cls, image_processor: Any, **settings: Any) -> QwenVideoProcessor:
        """The video processor that goes with a Qwen-VL image processor (same patch grid and normalisation)."""
        ip = image_processor
        return cls(
            patch_size=ip.patch_size,
            merge_size=ip.merge_size,
            temporal_patch_size=getattr(ip, "temporal_patch_size", FRAME_FACTOR),
            image_mean=ip.image_mean,
            image_std=ip.image_std,
            rescale_factor=getattr(ip, "rescale_factor", 1 / 255),
            **settings,
        )

    def load(self, src: Any, **settings: Any) -> Video | VideoPlan:
        """One video sampled and resized by this processor's settings (``settings`` override them); while
        :attr:`counting`, a file's :class:`VideoPlan` (its header read, no frame decoded)."""
        opts = vars(replace(self.video_settings, **settings))
        load = plan_video if self.counting and not isinstance(src, (list, tuple)) else load_video
        return load(src, factor=self.patch_size * self.merge_size, base_dir=self.base_dir, **opts)

    def __call__(self, videos: Any, *, video_metadata: Any = None, return_tensors: Any = None, **kwargs: Any):
        settings = {k: v for k, v in kwargs.items() if v is not None}
        unknown = sorted(set(settings) - set(self.settings) - {"return_metadata", "do_sample_frames"})
        if unknown:
            raise TypeError(
                f"QwenVideoProcessor takes no {', '.join(unknown)}; its settings: {', '.join(self.settings)}"
            )
        settings.pop("return_metadata", None), settings.pop("do_sample_frames", None)
        batch = make_batched_videos(videos)
        metas = list(video_metadata) if video_metadata is not None else [None] * len(batch)
        rows, grids, out_meta = [], [], []
        for item, meta in zip(batch, metas, strict=True):
            video = self._video(item, meta, settings)
            pixels, grid = self.pixels(video)
            rows.append(pixels)
            grids.append(grid)
            out_meta.append(
                VideoMetadata(total_num_frames=video.total_frames, fps=video.fps, frames_indices=list(video.indices))
            )
        data = {
            "pixel_values_videos": np.concatenate(rows) if len(rows) > 1 else rows[0],
            "video_grid_thw": np.asarray(grids, dtype=np.int64),
            "video_metadata": out_meta,
        }
        return BatchFeature(data, tensor_type=return_tensors, skip_tensor_conversion=["video_metadata"])

    def pixels(self, video: Video | VideoPlan) -> tuple[np.ndarray, list[int]]:
        """``(rows, [grid_t, grid_h, grid_w])`` of a loaded video: rescaled and normalised in float64, patchified, and
        stored as float32. One temporal patch of frames at a time (the rows are ordered by temporal grid first), so
        the float64 work is never more than a patch's frames: the same values as converting the whole video at once,
        in about the output's own memory. A :class:`VideoPlan` (counting) gives its grid and rows of no values."""
        tp, p = self.temporal_patch_size, self.patch_size
        if isinstance(video, VideoPlan):
            t, gh, gw = -(-len(video.indices) // tp), video.height // p, video.width // p
            return np.zeros((t * gh * gw, 0), dtype=np.float32), [t, gh, gw]
        frames = list(video.frames) + [video.frames[-1]] * (-len(video.frames) % tp)  # an odd count: the last again
        w, h = frames[0].size
        t = len(frames) // tp
        per_patch = (h // p) * (w // p)
        rows = np.empty((t * per_patch, 3 * tp * p * p), dtype=np.float32)
        for g in range(t):
            x = np.stack([np.asarray(im, dtype=np.float64) for im in frames[g * tp : (g + 1) * tp]])  # [tp, H, W, C]
            x = ((x * self.rescale_factor - self.image_mean) / self.image_std).transpose(0, 3, 1, 2)
            rows[g * per_patch : (g + 1) * per_patch] = patchify(
                x, patch_size=p, merge_size=self.merge_size, temporal_patch_size=tp
            )
        return rows, [t, h // p, w // p]

    def _video(self, item: Any, meta: Any, settings: dict[str, Any]) -> Video:
        if isinstance(item, (str, Path)) or (isinstance(item, list) and item and isinstance(item[0], (str, Path))):
            return self.load(item, **settings)
        frames = np.asarray(item)  # decoded frames, [T, H, W, C] uint8 (transformers' form)
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise DataError(
                f"decoded video frames must be [T, H, W, 3], got shape {frames.shape}", category="wrong type"
            )
        video = self.load([Image.fromarray(f.astype(np.uint8)) for f in frames], **settings)
        if meta is not None and meta.fps and meta.frames_indices is not None:  # frames sampled already: their timing
            total = meta.total_num_frames or len(frames)
            video = Video(video.frames, list(meta.frames_indices), float(meta.fps), int(total), video.source)
        return video


def preview_frames(src: Any, n: int = 8, *, base_dir: str | Path | None = None) -> list[Image.Image]:
    """Up to ``n`` frames spread evenly over a video (file or frame list), as found (not resized): what a report
    shows of a video. Failures as :func:`load_video`'s."""
    if isinstance(src, (list, tuple)):
        picks = np.linspace(0, len(src) - 1, min(n, len(src))).round().astype(int).tolist()
        return [load_image(src[i], max_pixels=None, base_dir=base_dir) for i in picks]
    info = probe_video(src, base_dir=base_dir)
    picks = np.linspace(0, info.total_frames - 1, min(n, info.total_frames)).round().astype(int).tolist()
    return list(iter_frames(info.path, picks))


def use_video_settings(processor: Any, **settings: Any) -> None:
    """Make ``processor`` sample and size videos by ``settings`` (those of :class:`VideoSettings`, checked); a
    processor without a :class:`QwenVideoProcessor` (a text tokenizer, a stock one) is left as it is."""
    vp = getattr(processor, "video_processor", None)
    if isinstance(vp, QwenVideoProcessor):
        vp.video_settings = VideoSettings(**settings)


@contextmanager
def counting_videos(processor: Any) -> Iterator[None]:
    """Within it, ``processor``'s videos are planned from their headers and not decoded: the prompt's tokens
    (video tokens, Qwen3-VL's timestamps) come out exactly as when encoding, its ``pixel_values_videos`` have no
    values. How preflight counts a record's tokens before training without decoding a frame (a 10-hour video is
    refused by its count, never decoded). A processor without a :class:`QwenVideoProcessor` is left as it is."""
    vp = getattr(processor, "video_processor", None)
    if not isinstance(vp, QwenVideoProcessor):
        yield
        return
    was, vp.counting = vp.counting, True
    try:
        yield
    finally:
        vp.counting = was


def _resized(im: Image.Image, w: int, h: int) -> Image.Image:
    im = im if im.mode == "RGB" else im.convert("RGB")
    return im if im.size == (w, h) else im.resize((w, h), Image.Resampling.BICUBIC)


def _video_path(src: Any, base_dir: str | Path | None) -> Path:
    if isinstance(src, str) and src.startswith(("http://", "https://")):
        raise DataError(
            f"video URLs are not fetched (offline): {src[:80]}; download it and give its path",
            category="unsupported video",
        )
    if not isinstance(src, (str, Path)) or not str(src).strip():
        raise DataError(
            f"wrong type for a video: {src!r:.80} (want a file path or a list of frames)", category="wrong type"
        )
    return local_file(src, base_dir)


def _open(path: Path):
    try:
        container = av.open(str(path))
    except (av.error.FFmpegError, UnicodeDecodeError) as exc:
        raise DataError(f"not a readable video ({_short(exc)}): {path}", category="corrupt video") from exc
    if not container.streams.video:
        container.close()
        raise DataError(f"video has no frames (no video stream): {path}", category="empty video")
    return container


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."
