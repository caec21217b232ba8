"""Write this example's task: colour-naming records with their images, as any data of your own would be.

    python examples/your_task/make_data.py                    # -> examples/your_task/data/{train,heldout}.jsonl
    python examples/your_task/make_data.py --format parquet   # -> .../data/{train,heldout}.parquet
    python examples/your_task/make_data.py --format dataset   # -> .../data/{train,heldout}/ (datasets save_to_disk)
    python examples/your_task/make_data.py --out /tmp/colors

Each record has ``id``, ``prompt`` (``<image>`` marks where the image goes), ``images``, ``answer``, and a field of
our own, ``vocabulary`` (the possible answers), which the reader keeps in the record's metadata and our reward
function reads. In JSONL the images are PNG files, referenced by paths relative to the JSONL file; in Parquet and in
a ``datasets`` folder they are embedded, written by ``datasets``' ``Image`` feature (``{"bytes", "path"}``, as on the
Hugging Face hub). The three formats hold the same records and the same pixels. Held-out images are drawn with
another seed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import datasets
from PIL import Image

COLORS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (240, 210, 30)}
PROMPT = "<image>What colour is this image? Answer with one word."
FORMATS = ("jsonl", "parquet", "dataset")


def image(rgb: tuple[int, int, int], rng: random.Random, size: int = 56, noise: int = 24) -> Image.Image:
    """A square of colour ``rgb`` with uniform noise of +-``noise`` on every channel of every pixel."""
    pixels = [tuple(max(0, min(255, c + rng.randint(-noise, noise))) for c in rgb) for _ in range(size * size)]
    im = Image.new("RGB", (size, size))
    im.putdata(pixels)
    return im


def records(split: str, n: int, seed: int) -> list[dict]:
    """``n`` records of ``split``, each with its image in memory."""
    rng = random.Random(seed)
    names = list(COLORS)
    rows = []
    for i in range(n):
        name = names[i % len(names)]  # balanced classes
        im = image(COLORS[name], rng)
        rows.append({"id": f"{split}-{i}", "prompt": PROMPT, "images": [im], "answer": name, "vocabulary": names})
    return rows


def write_jsonl(out: Path, split: str, rows: list[dict]) -> Path:
    """One JSON object per line; each image a PNG file under ``images/``, named by its path relative to the file."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    with open(out / f"{split}.jsonl", "w") as f:
        for row in rows:
            path = f"images/{row['id']}.png"
            row["images"][0].save(out / path)
            f.write(json.dumps({**row, "images": [path]}) + "\n")
    return out / f"{split}.jsonl"


def write_dataset(out: Path, split: str, rows: list[dict], fmt: str) -> Path:
    """A ``datasets.Dataset`` with the images in an ``Image`` feature (PNG bytes), as a Parquet file or a folder."""
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "prompt": datasets.Value("string"),
            "images": datasets.Sequence(datasets.Image()),
            "answer": datasets.Value("string"),
            "vocabulary": datasets.Sequence(datasets.Value("string")),
        }
    )
    ds = datasets.Dataset.from_list(rows, features=features)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        ds.to_parquet(out / f"{split}.parquet")
        return out / f"{split}.parquet"
    ds.save_to_disk(out / split)
    return out / split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"), help="folder to write")
    parser.add_argument("--train", type=int, default=1024, help="training records")
    parser.add_argument("--heldout", type=int, default=64, help="held-out records")
    parser.add_argument("--format", default="jsonl", choices=FORMATS, help="jsonl (default), parquet or dataset")
    args = parser.parse_args()
    out = Path(args.out)
    datasets.disable_progress_bars()
    written = []
    for split, n, seed in (("train", args.train, 0), ("heldout", args.heldout, 1)):
        rows = records(split, n, seed)
        if args.format == "jsonl":
            written.append(write_jsonl(out, split, rows))
        else:
            written.append(write_dataset(out, split, rows, args.format))
    print(f"wrote {args.train} training and {args.heldout} held-out records: {written[0]}, {written[1]}")


if __name__ == "__main__":
    main()
