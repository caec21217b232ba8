"""Small record files the tests write for text models: one spelling, used by every test that needs them."""

from __future__ import annotations

import json
from pathlib import Path

COLOURS = ("red", "green", "blue", "yellow", "black", "white", "purple", "orange")


def say_the_colour(folder: Path, n: int = 16, colours: int = 8) -> Path:
    """``folder/colours.jsonl``: ``n`` text records "Say the colour red." -> ``red``, cycling through the first
    ``colours`` of :data:`COLOURS` (an ``exact_match`` task a tiny text model learns in a few SFT steps)."""
    words = COLOURS[:colours]
    path = Path(folder) / "colours.jsonl"
    rows = [
        {"id": f"c{i}", "prompt": f"Say the colour {words[i % colours]}.", "answer": words[i % colours]}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
