"""The synthetic verifiable visual tasks (``TASKS``), each a function ``(n, rng, **options) -> [(image, question,
answer, metadata)]`` drawn with PIL from the caller's ``rng`` (``data_pipelines.synthetic`` turns them into records).

Each task has exact answers:

- ``"color"``: name the colour of the image (``mode="solid"``) or of the one shape on it
  (``mode="object"``); ``num_colors`` 2..8 (default 4) or an explicit ``colors`` list, 56x56 images by
  default (4 image tokens).
- ``"yes_no"``: "Is this image {color}?" of a solid-colour image (as ``"color"``), answered ``yes`` for
  half the records and ``no`` for the other half (the colour asked is another of the palette), so one answer
  for every image scores 0.5.
- ``"mark_color"``: name the colour of a small mark that cannot be read at the resolution the image is shown
  at (a checkerboard of the colour and its complement, one pixel per square, which averages to grey once the
  224x224 image is shrunk to the model's 112x112) but is plain in a zoomed view of its quadrant; the quadrant
  is lighter than the others, a cue that shows at any resolution. ``metadata["demonstration"]`` is the call that
  solves it (``zoom`` of that quadrant), for supervised demonstrations (docs/tools.md).
- ``"shape"``: name the shape (circle, square, triangle, star, hexagon, cross, diamond, pentagon; the
  first ``num_shapes``).
- ``"count_shapes"``: how many shapes of one kind; ``min_count``..``max_count``, ``distractors`` shapes
  of another kind that must not be counted.
- ``"triangle_angle"``: two angles of a triangle are labelled in degrees, the third is marked "?";
  ``angle_step`` sets the difficulty (10: multiples of ten, 1: any whole degree).

The same ``(task, n, seed, options)`` gives the same records, pixel for pixel. Labels of the
classification tasks are balanced (each class ``n // k`` or ``n // k + 1`` times, order shuffled).
"""

from __future__ import annotations

import math
import random

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from data_pipelines.drawing import (
    BACKGROUND,
    COLORS,
    DRAW_COLORS,
    PLURALS,
    SHAPES,
    add_noise,
    draw_shape,
    triangle_vertices,
)


def _balanced(vocab: list[str], n: int, rng: random.Random) -> list[str]:
    labels = [vocab[i % len(vocab)] for i in range(n)]
    rng.shuffle(labels)
    return labels


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi}, got {value}")


def _color(
    n: int,
    rng: random.Random,
    *,
    num_colors: int = 4,
    colors: list[str] | None = None,
    image_size: int = 56,
    mode: str = "solid",
    noise: int = 0,
    question: str | None = None,
) -> list[tuple]:
    if mode not in ("solid", "object"):
        raise ValueError(f"mode must be 'solid' or 'object', got {mode!r}")
    if colors is None:
        _check_range("num_colors", num_colors, 2, 8)
        vocab = list(COLORS)[:num_colors]
    else:  # an explicit palette, e.g. words the tokenizer keeps whole
        vocab = list(colors)
        unknown = [c for c in vocab if c not in COLORS]
        if unknown or len(set(vocab)) != len(vocab) or len(vocab) < 2:
            raise ValueError(f"colors must be 2+ distinct names from {list(COLORS)}, got {colors!r}")
    question = question or (
        "What colour is this image? Answer with one word."
        if mode == "solid"
        else "What colour is the shape? Answer with one word."
    )
    out = []
    for name in _balanced(vocab, n, rng):
        if mode == "solid":
            im = Image.new("RGB", (image_size, image_size), COLORS[name])
        else:
            im = Image.new("RGB", (image_size, image_size), BACKGROUND)
            r = image_size * rng.uniform(0.22, 0.38)
            c = [rng.uniform(r, image_size - r) for _ in range(2)]
            draw_shape(ImageDraw.Draw(im), rng.choice(SHAPES[:4]), c, r, COLORS[name], rng.uniform(0, 2 * math.pi))
        out.append(
            (add_noise(im, noise, rng), question, name, {"vocabulary": vocab, "rgb": list(COLORS[name]), "mode": mode})
        )
    return out


def _yes_no(
    n: int,
    rng: random.Random,
    *,
    num_colors: int = 4,
    colors: list[str] | None = None,
    image_size: int = 56,
    noise: int = 0,
    question: str = "Is this image {color}? Answer yes or no.",
    paired: bool = False,
) -> list[tuple]:
    """A yes/no visual question: a solid-colour image and "Is this image {color}?", the colour asked being
    the image's own for half the records (answer yes) and another colour of the palette for the other half
    (no), so always answering one word scores 0.5. Image colours are balanced too. ``paired``: ``n // 2``
    images, each asked its own colour then another one, side by side (train with ``data.group_size: 2``, so
    an image's two questions share a rollout batch)."""
    if "{color}" not in question:
        raise ValueError(f"question must contain {{color}}, got {question!r}")
    drawn = n // 2 if paired else n
    palette = [
        (im, name, meta)
        for im, _, name, meta in _color(
            drawn, rng, num_colors=num_colors, colors=colors, image_size=image_size, noise=noise
        )
    ]
    if paired:
        palette = [p for p in palette for _ in range(2)]
        answers = ["yes", "no"] * drawn
    else:
        answers = _balanced(["yes", "no"], n, rng)
    out = []
    for (im, name, meta), answer in zip(palette, answers):
        asked = name if answer == "yes" else rng.choice([c for c in meta["vocabulary"] if c != name])
        out.append(
            (
                im,
                question.format(color=asked),
                answer,
                {"vocabulary": ["yes", "no"], "color": name, "asked": asked, "rgb": meta["rgb"]},
            )
        )
    return out


MARK_COLORS = ("red", "green", "blue", "white")  # none is another's complement: each checkerboard is its own
QUADRANTS = ("top_left", "top_right", "bottom_left", "bottom_right")


def _mark_color(
    n: int,
    rng: random.Random,
    *,
    colors: list[str] | None = None,
    image_size: int = 224,
    mark_size: int = 48,
    light: int = 230,
    dark: int = 40,
    question: str = "What colour is the small mark?",
    demo_zooms: int = 1,
    demo_share: float = 1.0,
    cue: bool = True,
) -> list[tuple]:
    """A small mark's colour, readable only by zooming into its (lighter) quadrant; see the module doc.
    ``demo_zooms`` 2: the demonstration zooms again into the centre of the first zoom's image (image 2), so that
    tool trajectories return images in turns 2 and 3. ``demo_share``: the share of records whose demonstration
    calls the tool; the others answer at once (a guess, the mark being unreadable), so that a policy cold-started
    on them calls the tool for about that share of images and reinforcement learning has the choice to learn.
    ``cue`` False: the whole background is the checkerboard's mean grey, so that neither a lighter quadrant nor
    the mark's blur tells where the mark is; demonstrations on such images teach the call and the reading but not
    where to look, which is left to reinforcement learning on images with the cue."""
    if demo_zooms not in (1, 2):
        raise ValueError(f"demo_zooms must be 1 or 2, got {demo_zooms}")
    _check_range("demo_share", demo_share, 0.0, 1.0)
    names = list(colors or MARK_COLORS)
    half = image_size // 2
    if mark_size % 2 or mark_size > half - 8:
        raise ValueError(f"mark_size must be even and fit in a quadrant with a margin, got {mark_size}")
    answers = _balanced(names, n, rng)
    out = []
    for answer in answers:
        quadrant = rng.randrange(4)
        qx, qy = (quadrant % 2) * half, (quadrant // 2) * half
        if cue:
            arr = np.full((image_size, image_size, 3), dark, dtype=np.uint8)
            arr[qy : qy + half, qx : qx + half] = light
        else:  # the mean of a colour and its complement: the mark is a grey among grey once shrunk
            arr = np.full((image_size, image_size, 3), 128, dtype=np.uint8)
        # even coordinates: every square's colour is fixed by the parity of its pixel in the whole image
        x = qx + 4 + 2 * rng.randrange((half - 8 - mark_size) // 2 + 1)
        y = qy + 4 + 2 * rng.randrange((half - 8 - mark_size) // 2 + 1)
        color = np.array(COLORS[answer], dtype=np.int16)
        yy, xx = np.mgrid[0:mark_size, 0:mark_size]
        squares = np.where(((yy + xx) % 2 == 0)[..., None], color, 255 - color).astype(np.uint8)
        arr[y : y + mark_size, x : x + mark_size] = squares
        region = QUADRANTS[quadrant]
        calls = [{"name": "zoom", "arguments": {"region": region}}]
        calls += [{"name": "zoom", "arguments": {"region": "center", "image": 2}}] * (demo_zooms - 1)
        if demo_share < 1.0 and rng.random() >= demo_share:  # drawn only then: records of share 1 unchanged
            calls = []
        meta = {
            "vocabulary": names,
            "region": region,
            "box": [x, y, x + mark_size, y + mark_size],
            "demonstration": calls,
        }
        out.append((Image.fromarray(arr, "RGB"), question, answer, meta))
    return out


def _shape(
    n: int,
    rng: random.Random,
    *,
    num_shapes: int = 4,
    image_size: int = 84,
    rotate: bool = False,
    noise: int = 0,
    question: str | None = None,
) -> list[tuple]:
    _check_range("num_shapes", num_shapes, 2, len(SHAPES))
    vocab = list(SHAPES[:num_shapes])
    question = question or "What shape is in the image? Answer with one word."
    out = []
    for name in _balanced(vocab, n, rng):
        im = Image.new("RGB", (image_size, image_size), (255, 255, 255))
        r = image_size * rng.uniform(0.25, 0.4)
        c = [rng.uniform(r, image_size - r) for _ in range(2)]
        color = rng.choice(DRAW_COLORS)
        draw_shape(ImageDraw.Draw(im), name, c, r, COLORS[color], rng.uniform(-0.3, 0.3) if rotate else 0.0)
        out.append((add_noise(im, noise, rng), question, name, {"vocabulary": vocab, "color": color}))
    return out


def _count_shapes(
    n: int,
    rng: random.Random,
    *,
    shape: str = "circle",
    min_count: int = 1,
    max_count: int = 5,
    distractors: int = 0,
    image_size: int = 112,
    noise: int = 0,
) -> list[tuple]:
    if shape != "random" and shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES} or 'random', got {shape!r}")
    _check_range("min_count", min_count, 0, max_count)
    cell = max(12, image_size // 5)
    grid = [(x, y) for y in range(image_size // cell) for x in range(image_size // cell)]
    if max_count + distractors > len(grid):
        raise ValueError(
            f"{max_count} shapes + {distractors} distractors do not fit a {image_size}px image "
            f"({len(grid)} places); make the image larger"
        )
    vocab = [str(k) for k in range(min_count, max_count + 1)]
    out = []
    for count in _balanced(vocab, n, rng):
        target = rng.choice(SHAPES[:4]) if shape == "random" else shape
        other = [s for s in SHAPES[:4] if s != target]
        im = Image.new("RGB", (image_size, image_size), (255, 255, 255))
        draw = ImageDraw.Draw(im)
        cells = rng.sample(grid, int(count) + distractors)  # distinct cells: shapes never overlap
        kinds = [target] * int(count) + [rng.choice(other) for _ in range(distractors)]
        for (gx, gy), kind in zip(cells, kinds):
            r = cell * rng.uniform(0.35, 0.45)
            cx = gx * cell + cell / 2 + rng.uniform(-1, 1) * (cell / 2 - r)
            cy = gy * cell + cell / 2 + rng.uniform(-1, 1) * (cell / 2 - r)
            draw_shape(draw, kind, (cx, cy), r, COLORS[rng.choice(DRAW_COLORS)])
        plural = PLURALS.get(target, target + "s")
        question = f"How many {plural} are in the image? Answer with a number."
        out.append(
            (
                add_noise(im, noise, rng),
                question,
                count,
                {"vocabulary": vocab, "counted_shape": target, "distractors": distractors},
            )
        )
    return out


def _triangle_angle(
    n: int,
    rng: random.Random,
    *,
    angle_step: int = 10,
    min_angle: int = 20,
    image_size: int = 224,
    side_labels: bool = False,
    noise: int = 0,
) -> list[tuple]:
    _check_range("angle_step", angle_step, 1, 60)
    if 3 * min_angle > 180 - 2 * angle_step:
        raise ValueError(f"min_angle {min_angle} leaves no triangles with angle_step {angle_step}")
    values = [v for v in range(angle_step, 180, angle_step) if v >= min_angle]
    triples = [(a, b, 180 - a - b) for a in values for b in values if 180 - a - b in values]
    vocab = sorted({str(t[2]) for t in triples}, key=int)
    font = ImageFont.load_default(size=max(10, image_size // 14))
    question = (
        "Two angles of the triangle are labelled in degrees. What is the angle marked '?', in degrees? "
        "Answer with a number."
    )
    out = []
    for _ in range(n):
        angles = list(rng.choice(triples))
        unknown = rng.randrange(3)
        verts = triangle_vertices(angles, image_size, rng)
        im = Image.new("RGB", (image_size, image_size), (255, 255, 255))
        draw = ImageDraw.Draw(im)
        draw.polygon(verts, outline=(0, 0, 0), width=max(1, image_size // 112))
        gx, gy = sum(v[0] for v in verts) / 3, sum(v[1] for v in verts) / 3
        for k, (vx, vy) in enumerate(verts):
            text = "?" if k == unknown else f"{angles[k]}°"
            t = 0.32 if angles[k] >= 40 else 0.45  # further in for sharp corners
            draw.text((vx + t * (gx - vx), vy + t * (gy - vy)), text, fill=(0, 0, 0), font=font, anchor="mm")
        if side_labels:  # decoy numbers (side lengths) that play no part in the answer
            for k in range(3):
                (ax, ay), (bx, by) = verts[k], verts[(k + 1) % 3]
                mx, my = (ax + bx) / 2, (ay + by) / 2
                draw.text(
                    (mx + 0.15 * (mx - gx), my + 0.15 * (my - gy)),
                    str(rng.randint(2, 15)),
                    fill=(40, 40, 200),
                    font=font,
                    anchor="mm",
                )
        out.append(
            (
                add_noise(im, noise, rng),
                question,
                str(angles[unknown]),
                {"vocabulary": vocab, "angles": angles, "unknown_vertex": unknown},
            )
        )
    return out


TASKS = {
    "color": _color,
    "yes_no": _yes_no,
    "mark_color": _mark_color,
    "shape": _shape,
    "count_shapes": _count_shapes,
    "triangle_angle": _triangle_angle,
}
