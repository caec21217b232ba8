"""Decode time and peak memory of a video through vlrft's torchvision-free video processor (issue 61, item 5)::

    python scripts/bench_video.py [--frames 64] [--size 448] [--repeats 5]

The video: ``--frames`` frames of ``--size`` x ``--size`` at 2 frames per second (so that the default sampling,
2 fps, takes every frame), H.264 in mp4, written here with PyAV (a moving gradient with noise, so that the encoder
cannot make it trivially small). Three measurements, each in a fresh process (its own peak RSS), one thread:

1. **the limit**: PyAV decoding every frame to an RGB PIL image (``frame.to_image()``), the least any decoder that
   hands frames to PIL does, keeping no frame;
2. ``load_video`` at the Qwen2.5-VL default budget (``factor`` 28, qwen-vl-utils' per-frame and total pixel bounds):
   the sampled frames decoded lazily and resized, all kept (what the processor then reads);
3. ``QwenVideoProcessor`` of a Qwen2.5-VL shape (patch 14, merge 2, temporal patch 2): the above plus rescale,
   normalisation and patchify into ``pixel_values_videos`` (float32).

Each time is the median of ``--repeats`` calls (the first call, with its imports, not counted); each peak is the
process's maximum resident set over its calls minus its resident set before the first, against the size of what the
step returns. Prints the machine, the settings and a markdown table for docs/benchmarks.md; the ratio of 3 to 1 is
the figure (the time vlrft adds to the decode a video costs anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QWEN25 = dict(  # Qwen2.5-VL's video processor shape and normalisation
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    image_mean=(0.48145466, 0.4578275, 0.40821073),
    image_std=(0.26862954, 0.26130258, 0.27577711),
)


def write(path: Path, frames: int, size: int) -> None:
    import numpy as np
    from PIL import Image

    from data_pipelines.synthetic_video import write_video

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size]
    images = []
    for t in range(frames):
        base = ((x + 4 * t) % size) * 255 // size  # a gradient that moves right
        rgb = np.stack([base, (y * 255 // size) + 0 * base, 255 - base], -1).astype(np.int16)
        rgb = rgb + rng.integers(-24, 25, rgb.shape)
        images.append(Image.fromarray(rgb.clip(0, 255).astype(np.uint8)))
    write_video(images, path, fps=2)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def measure(step: str, path: str, repeats: int) -> dict:
    """In this process: the step ``repeats + 1`` times; median seconds of all but the first, peak RSS growth."""
    import av
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from data_pipelines.video import QwenVideoProcessor, load_video

    processor = QwenVideoProcessor(**QWEN25)

    def decode_all():
        with av.open(path) as c:
            n = 0
            for frame in c.decode(c.streams.video[0]):
                frame.to_image()
                n += 1
        return {"frames": n, "bytes": 0}

    def load():
        v = load_video(path, factor=28)
        w, h = v.frames[0].size
        return {"frames": len(v.frames), "size": f"{w}x{h}", "bytes": len(v.frames) * w * h * 3}

    def process():
        out = processor([path])
        pv = np.asarray(out["pixel_values_videos"])
        return {"grid": [int(x) for x in np.asarray(out["video_grid_thw"])[0]], "bytes": pv.nbytes}

    fn = {"decode": decode_all, "load_video": load, "processor": process}[step]
    before = rss_mb()
    times, info = [], {}
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        info = fn()
        if i:
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {**info, "seconds": statistics.median(times), "peak_mb": peak - before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.child[0], a.child[1], a.repeats)))
        return
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())
    import av
    import PIL

    print(
        f"Machine: {cpu}, {os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.2f}; Python "
        f"{platform.python_version()}, PyAV {av.__version__}, Pillow {PIL.__version__}; one thread per process."
    )
    with tempfile.TemporaryDirectory(prefix="bench-video-") as tmp:
        path = Path(tmp) / "video.mp4"
        write(path, a.frames, a.size)
        print(
            f"\nVideo: {a.frames} frames of {a.size}x{a.size} at 2 fps, H.264 mp4 ({path.stat().st_size / 2**20:.1f} "
            f"MB); the median of {a.repeats} calls, the first not counted; peak: resident set growth of a fresh "
            "process.\n"
        )
        rows = {}
        for step in ("decode", "load_video", "processor"):
            env = dict(os.environ, OMP_NUM_THREADS="1")
            cmd = [sys.executable, __file__, "--repeats", str(a.repeats), "--child", step, str(path)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            rows[step] = json.loads(out.strip().splitlines()[-1])
    d, lv, p = rows["decode"], rows["load_video"], rows["processor"]
    print("| step | seconds | x the decode | peak memory growth | what it returns |")
    print("|---|---|---|---|---|")
    limit = f"| PyAV: decode all {d['frames']} frames to RGB (the limit) | {d['seconds']:.3f} | 1.00 |"
    print(f"{limit} {d['peak_mb']:.0f} MB | nothing kept |")
    print(
        f"| `load_video`, Qwen2.5-VL default budget | {lv['seconds']:.3f} | {lv['seconds'] / d['seconds']:.2f} | "
        f"{lv['peak_mb']:.0f} MB | {lv['frames']} frames of {lv['size']} ({lv['bytes'] / 2**20:.1f} MB of RGB) |"
    )
    print(
        f"| `QwenVideoProcessor` (Qwen2.5-VL shape) | {p['seconds']:.3f} | {p['seconds'] / d['seconds']:.2f} | "
        f"{p['peak_mb']:.0f} MB | `pixel_values_videos` of grid {p['grid']} ({p['bytes'] / 2**20:.1f} MB float32) |"
    )
    print(f"\n$ python scripts/bench_video.py --frames {a.frames} --size {a.size} --repeats {a.repeats}")


if __name__ == "__main__":
    main()
