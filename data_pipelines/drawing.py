"""Drawing for the synthetic tasks (``data_pipelines.synthetic_tasks``): the colour palette, the shapes and
their polygons, pixel noise and a triangle with given angles. Pure PIL/numpy, seeded by the caller's ``rng``."""

from __future__ import annotations

import math
import random

import numpy as np
from PIL import Image, ImageDraw

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (240, 210, 30),
    "purple": (130, 40, 170),
    "orange": (245, 130, 20),
    "black": (15, 15, 15),
    "white": (245, 245, 245),
    "brown": (140, 85, 35),
    "pink": (245, 150, 190),  # only through `colors=` (num_colors takes the first 8)
}
SHAPES = ("circle", "square", "triangle", "star", "hexagon", "cross", "diamond", "pentagon")
PLURALS = {"cross": "crosses"}
BACKGROUND = (128, 128, 128)  # object mode: a grey no colour name is close to
DRAW_COLORS = ("red", "green", "blue", "yellow", "purple", "orange", "black")  # on white backgrounds


def _polygon(shape: str, cx: float, cy: float, r: float, rotation: float = 0.0) -> list[tuple[float, float]]:
    def ring(k: int, radius: float, start: float) -> list[tuple[float, float]]:
        return [
            (
                cx + radius * math.cos(start + rotation + 2 * math.pi * j / k),
                cy + radius * math.sin(start + rotation + 2 * math.pi * j / k),
            )
            for j in range(k)
        ]

    up = -math.pi / 2
    if shape == "square":
        return ring(4, r, math.pi / 4)
    if shape == "triangle":
        return ring(3, r, up)
    if shape == "pentagon":
        return ring(5, r, up)
    if shape == "hexagon":
        return ring(6, r, 0.0)
    if shape == "star":
        outer, inner = ring(5, r, up), ring(5, 0.42 * r, up + math.pi / 5)
        return [p for pair in zip(outer, inner) for p in pair]
    if shape == "diamond":  # a rhombus, narrower than a turned square
        pts = [(0, -r), (0.6 * r, 0), (0, r), (-0.6 * r, 0)]
    elif shape == "cross":
        a, b = r, 0.33 * r
        pts = [
            (-b, -a),
            (b, -a),
            (b, -b),
            (a, -b),
            (a, b),
            (b, b),
            (b, a),
            (-b, a),
            (-b, b),
            (-a, b),
            (-a, -b),
            (-b, -b),
        ]
    else:
        raise ValueError(f"unknown shape {shape!r}")
    c, s = math.cos(rotation), math.sin(rotation)
    return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts]


def draw_shape(
    draw: ImageDraw.ImageDraw,
    shape: str,
    center: tuple[float, float],
    radius: float,
    fill: tuple[int, int, int],
    rotation: float = 0.0,
) -> None:
    """Draw one filled shape of ``SHAPES`` centred at ``center`` within ``radius``."""
    cx, cy = center
    if shape == "circle":
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=fill)
    else:
        draw.polygon(_polygon(shape, cx, cy, radius, rotation), fill=fill)


def add_noise(im: Image.Image, amount: int, rng: random.Random) -> Image.Image:
    """``im`` with uniform integer noise in ``[-amount, amount]`` per channel, drawn from ``rng``."""
    if amount <= 0:
        return im
    arr = np.asarray(im).astype(np.int16)
    arr += np.random.default_rng(rng.getrandbits(32)).integers(-amount, amount + 1, arr.shape, dtype=np.int16)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")


def triangle_vertices(angles: list[int], size: int, rng: random.Random) -> list[tuple[float, float]]:
    """Vertices with interior angles ``angles`` (at vertex 0, 1, 2), turned at random, fitted to the image."""
    a, b = math.radians(angles[0]), math.radians(angles[1])
    # Vertex 0 at the origin, vertex 1 at (1, 0); vertex 2 where the sides at angles a and b meet.
    t = math.sin(b) / math.sin(a + b)
    pts = [(0.0, 0.0), (1.0, 0.0), (t * math.cos(a), -t * math.sin(a))]
    turn = rng.uniform(0, 2 * math.pi)
    pts = [(x * math.cos(turn) - y * math.sin(turn), x * math.sin(turn) + y * math.cos(turn)) for x, y in pts]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    margin = 0.1 * size
    scale = (size - 2 * margin) / max(max(xs) - min(xs), max(ys) - min(ys))
    ox = margin + (size - 2 * margin - scale * (max(xs) - min(xs))) / 2
    oy = margin + (size - 2 * margin - scale * (max(ys) - min(ys))) / 2
    return [(ox + scale * (x - min(xs)), oy + scale * (y - min(ys))) for x, y in pts]
