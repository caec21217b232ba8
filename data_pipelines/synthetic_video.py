"""A synthetic video task one frame cannot answer: does the dot move left or right (``"dot_motion"``).

Each video is a real file (H.264 mp4 by default, written with PyAV): a dot of a random palette colour on grey,
starting at a random place, moving ``step`` pixels a frame left or right. The start (place and colour) is drawn
before, and independently of, the direction, from a range that leaves room for the whole move either way, so the
first frame has the same distribution for both answers; any two frames tell the direction. Directions are balanced
(``n // 2`` each, shuffled). The same ``(n, seed, options)`` gives the same videos.

Records are plain rows in the issue's record format (``id``, ``prompt`` with a ``<video>`` placeholder,
``videos: [absolute path]``, ``answer``, ``task``, ``metadata``), ready for a JSONL file anywhere (the readers
resolve a relative video path from the data file's folder).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import av
import numpy as np
from PIL import Image, ImageDraw

from data_pipelines.drawing import COLORS, DRAW_COLORS

DIRECTIONS = ("left", "right")
QUESTION = "<video>Does the dot move left or right? Answer with one word."
DOT_BACKGROUND = (128, 128, 128)


def dot_frames(
    start: tuple[float, float], color: str, direction: str, *, frames: int, step: float, size: int, radius: float
) -> list[Image.Image]:
    """The frames of one video: the dot at ``start`` then ``step`` pixels further ``direction`` each frame."""
    sign = -1 if direction == "left" else 1
    out = []
    for k in range(frames):
        x, y = start[0] + sign * step * k, start[1]
        im = Image.new("RGB", (size, size), DOT_BACKGROUND)
        ImageDraw.Draw(im).ellipse((x - radius, y - radius, x + radius, y + radius), fill=COLORS[color])
        out.append(im)
    return out


def write_video(frames: list[Image.Image], path: str | Path, *, fps: int, codec: str = "libx264") -> Path:
    """Write RGB frames as a video file with PyAV (``codec="gif"`` for a gif)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "rgb8" if codec == "gif" else "yuv420p"
        for im in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.asarray(im), format="rgb24")))
        container.mux(stream.encode())
    return path


def make_dot_motion_records(
    n: int,
    out_dir: str | Path,
    seed: int = 0,
    *,
    frames: int = 8,
    fps: int = 4,
    size: int = 64,
    step: float = 3.0,
    radius: float = 5.0,
    ext: str = "mp4",
) -> list[dict[str, Any]]:
    """``n`` dot-motion videos written into ``out_dir`` (``dot_motion-SEED-I.EXT``) and their records."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if frames < 2:
        raise ValueError(f"frames must be >= 2 (one frame cannot show motion), got {frames}")
    if ext not in ("mp4", "gif"):
        raise ValueError(f"ext must be 'mp4' or 'gif', got {ext!r}")
    travel = step * (frames - 1)
    lo, hi = radius + travel, size - radius - travel
    if lo >= hi:
        raise ValueError(f"size {size} leaves no room for a dot of radius {radius} moving {travel:g} px either way")
    rng = random.Random(f"vlrft-synthetic-video/dot_motion/{seed}")
    directions = [DIRECTIONS[i % 2] for i in range(n)]
    rng.shuffle(directions)
    records = []
    for i, direction in enumerate(directions):
        start = (rng.uniform(lo, hi), rng.uniform(radius, size - radius))  # drawn the same way for both directions
        color = rng.choice(DRAW_COLORS)
        video = dot_frames(start, color, direction, frames=frames, step=step, size=size, radius=radius)
        path = write_video(
            video, Path(out_dir) / f"dot_motion-{seed}-{i}.{ext}", fps=fps, codec="gif" if ext == "gif" else "libx264"
        )
        records.append(
            {
                "id": f"dot_motion-{seed}-{i}",
                "prompt": QUESTION,
                "videos": [str(path.resolve())],  # absolute: the JSONL may be anywhere
                "answer": direction,
                "task": "dot_motion",
                "metadata": {
                    "ground_truth": direction,
                    "vocabulary": list(DIRECTIONS),
                    "start": list(start),
                    "color": color,
                    "seed": seed,
                    "index": i,
                },
            }
        )
    return records
