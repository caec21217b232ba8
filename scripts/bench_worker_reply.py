"""Seconds to bring a tool's 4032x3024 RGB image (a phone photo: 36.6 MB of pixels, a 48.8 MB reply line once
pickled and base64-encoded) back through the worker pipe (``vlrft.workers``), with the reply read as it is now
(the chunks appended to one buffer, only the new bytes searched for the newline) and as it was before issue 64
(``buf += chunk`` on bytes and the whole buffer searched again: quadratic in the reply's size)::

    python scripts/bench_worker_reply.py [--width 4032 --height 3024 --repeat 3]

Each style: a user tool in a temporary file returning the image, called through a ``ToolBox`` (``isolation:
process``, one worker, warmed by one call), then ``--repeat`` timed calls; prints the best and the median.
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlrft.tools import ToolBox, ToolsConfig  # noqa: E402
from vlrft.tools.base import ToolCall  # noqa: E402
from vlrft.workers import Worker  # noqa: E402

TOOL = """
from PIL import Image


def photo():
    return Image.frombytes("RGB", ({w}, {h}), bytes(range(256)) * ({w} * {h} * 3 // 256) + bytes({w} * {h} * 3 % 256))


photo.schema = {{"type": "object", "properties": {{}}}}
"""


def quadratic_readline(self: Worker, deadline: float) -> bytes | None:
    """The reply read before issue 64: the buffer copied on every chunk and searched from its start."""
    fd = self.proc.stdout.fileno()
    buf = bytes(self.buf)
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            self.eof = True
            return None
        buf += chunk
    line, rest = buf.split(b"\n", 1)
    self.buf = bytearray(rest)
    return line


def timed(path: Path, repeat: int) -> list[float]:
    box = ToolBox(ToolsConfig(names=[f"{path}:photo"], num_workers=1, timeout_s=600))
    try:
        box.run(ToolCall("photo", {}), [])
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            result = box.run(ToolCall("photo", {}), [])
            times.append(time.perf_counter() - t0)
            assert result.images, result
        return times
    finally:
        box.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=4032)
    parser.add_argument("--height", type=int, default=3024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "photo_tool.py"
        path.write_text(TOOL.format(w=args.width, h=args.height))
        os.environ.setdefault("VLRFT_WORKER_LOG_DIR", str(Path(tmp) / "logs"))
        linear = Worker.readline
        for style, readline in (("now (linear)", linear), ("before (quadratic)", quadratic_readline)):
            Worker.readline = readline
            times = timed(path, args.repeat)
            print(
                f"{args.width}x{args.height} RGB reply, {style}: best {min(times):.2f} s, "
                f"median {statistics.median(times):.2f} s over {len(times)} calls",
                flush=True,
            )
        Worker.readline = linear


if __name__ == "__main__":
    main()
