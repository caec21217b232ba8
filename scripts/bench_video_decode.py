"""Decode time and peak memory of one video through ``data_pipelines.video`` (issue 61, item 5): a 64-frame 448x448
mp4 at 16 fps (4 s, written here with PyAV: moving noise, so the codec cannot collapse it), read at the default
settings (2 fps: 8 frames; the default per-frame and per-video pixel budgets), then patchified for Qwen2.5-VL. Beside
it, the same file's 64 frames all decoded and held, which is what a reader that keeps every frame would cost::

    python scripts/bench_video_decode.py [--frames 64 --size 448 --repeat 5]

Each measurement runs in a fresh process (peak resident memory is a process's high-water mark); prints the median
seconds and the peak RSS increase over the process's start.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_video(path: Path, frames: int, size: int, fps: int = 16) -> None:
    import av
    import numpy as np

    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.roll(base, 4 * i, axis=1), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())


def measure(mode: str, path: str) -> dict[str, float]:
    """In this process: seconds and peak RSS increase (MiB) of one way of reading ``path``."""
    import av
    import numpy as np

    from data_pipelines.video import QwenVideoProcessor

    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if mode == "sampled":
        vp = QwenVideoProcessor(
            patch_size=14, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3
        )
        out = vp([path])
        shape = list(out["pixel_values_videos"].shape)
    else:
        with av.open(path) as container:
            frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
        shape = list(frames.shape)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "peak_mib": (peak - start_rss) / 1024, "shape": shape}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--measure", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.mp4"
        write_video(path, args.frames, args.size)
        print(f"{args.frames} frames {args.size}x{args.size}, {path.stat().st_size / 1e6:.2f} MB mp4")
        for mode in ("sampled", "all frames held"):
            runs = []
            for _ in range(args.repeat):
                cmd = [sys.executable, __file__, "--measure", mode.split()[0], str(path)]
                runs.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
            secs = statistics.median(r["seconds"] for r in runs)
            peak = statistics.median(r["peak_mib"] for r in runs)
            print(f"{mode}: {secs:.3f} s median of {args.repeat}, peak RSS +{peak:.1f} MiB, output {runs[0]['shape']}")


if __name__ == "__main__":
    main()
