"""The built-in tools: ``zoom``, ``crop``, ``rotate`` (on an input image or one a tool returned) and ``calculator``
(arithmetic parsed, never evaluated as code).

Images are numbered from 1 in the order the policy saw them: the prompt's images, then those tools returned.
Boxes are ``[x0, y0, x1, y1]`` in pixels of the image as the policy was shown it (Qwen2.5-VL's grounding
convention: absolute coordinates of the resized input); the crop itself is cut from the full-resolution original,
so ``zoom`` returns detail the shown image did not have: the region scaled to the most pixels the model's
processor takes. ``crop`` returns the region at the scale it was shown at; ``rotate`` turns an image
counter-clockwise by ``degrees``.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from data_pipelines.images import load_image, qwen_size, resize_for_qwen
from vlrft.tools.base import Tool, ToolResult

REGIONS = {  # fractions of the width and height: (left, top, right, bottom)
    "top_left": (0.0, 0.0, 0.5, 0.5),
    "top_right": (0.5, 0.0, 1.0, 0.5),
    "bottom_left": (0.0, 0.5, 0.5, 1.0),
    "bottom_right": (0.5, 0.5, 1.0, 1.0),
    "center": (0.25, 0.25, 0.75, 0.75),
    "top": (0.0, 0.0, 1.0, 0.5),
    "bottom": (0.0, 0.5, 1.0, 1.0),
    "left": (0.0, 0.0, 0.5, 1.0),
    "right": (0.5, 0.0, 1.0, 1.0),
}


class ToolFailure(ValueError):
    """A tool refused its input (the model sees the message as the tool's error)."""


@dataclass
class ImageView:
    """An image of a trajectory: its full-resolution original and the size the policy was shown it at."""

    original: Image.Image
    shown: tuple[int, int]  # (width, height)


def view_of(image: Any, bounds: dict[str, int]) -> ImageView:
    """An image (path, PIL ...) at full resolution, with the size a model of image ``bounds`` (``min_pixels``,
    ``max_pixels``, ``factor``: the processor's) sees it at (its own size without bounds)."""
    original = (image if isinstance(image, Image.Image) else load_image(image, max_pixels=None)).convert("RGB")
    if not bounds:
        return ImageView(original, original.size)
    return ImageView(original, qwen_size(original.size, **bounds))


@dataclass
class ToolContext:
    """What a built-in tool sees of its trajectory: its images and the model's image bounds."""

    images: list[ImageView]
    bounds: dict[str, int] = field(default_factory=dict)  # min_pixels, max_pixels, factor (the processor's)


def _view(ctx: ToolContext, image: int) -> ImageView:
    if not 1 <= image <= len(ctx.images):
        raise ToolFailure(f"image {image} does not exist (this conversation has {len(ctx.images)})")
    return ctx.images[image - 1]


def _region(view: ImageView, region: str | None, box: list[float] | None) -> tuple[int, int, int, int]:
    """The pixel box of the original that ``region`` or ``box`` (in shown pixels) names."""
    if (region is None) == (box is None):
        raise ToolFailure("give either region or box")
    w, h = view.original.size
    if region is not None:
        fx0, fy0, fx1, fy1 = REGIONS[region]
    else:
        sw, sh = view.shown
        x0, y0, x1, y1 = box
        if not (0 <= x0 < x1 <= sw and 0 <= y0 < y1 <= sh):
            raise ToolFailure(f"box {box} is not inside the {sw}x{sh} image with x0 < x1 and y0 < y1")
        fx0, fy0, fx1, fy1 = x0 / sw, y0 / sh, x1 / sw, y1 / sh
    return (
        round(fx0 * w),
        round(fy0 * h),
        max(round(fx1 * w), round(fx0 * w) + 1),
        max(round(fy1 * h), round(fy0 * h) + 1),
    )


def _bounded(im: Image.Image, ctx: ToolContext, scale: float) -> Image.Image:
    """``im`` scaled by ``scale`` then to the processor's bounds (sides multiples of its factor)."""
    size = (max(1, round(im.width * scale)), max(1, round(im.height * scale)))
    if size != im.size:
        im = im.resize(size, Image.Resampling.BICUBIC)
    b = ctx.bounds
    if not b:
        return im
    return resize_for_qwen(im, min_pixels=b["min_pixels"], max_pixels=b["max_pixels"], factor=b["factor"])


def zoom(ctx: ToolContext, region: str | None = None, box: list[float] | None = None, image: int = 1) -> ToolResult:
    view = _view(ctx, image)
    part = view.original.crop(_region(view, region, box))
    most = ctx.bounds.get("max_pixels", part.width * part.height)
    return ToolResult(images=[_bounded(part, ctx, math.sqrt(most / (part.width * part.height)))])


def crop(ctx: ToolContext, region: str | None = None, box: list[float] | None = None, image: int = 1) -> ToolResult:
    view = _view(ctx, image)
    part = view.original.crop(_region(view, region, box))
    return ToolResult(images=[_bounded(part, ctx, view.shown[0] / view.original.width)])


def rotate(ctx: ToolContext, degrees: float, image: int = 1) -> ToolResult:
    view = _view(ctx, image)
    turned = view.original.rotate(degrees, expand=True, resample=Image.Resampling.BICUBIC)
    return ToolResult(images=[_bounded(turned, ctx, view.shown[0] / view.original.width)])


# -- calculator: a whitelist over Python's own expression grammar ------------------------------------------
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {
    name: getattr(math, name)
    for name in ("sqrt", "sin", "cos", "tan", "asin", "acos", "atan", "log", "log10", "exp", "floor", "ceil")
} | {"abs": abs, "round": round, "radians": math.radians, "degrees": math.degrees}
_CONSTANTS = {"pi": math.pi, "e": math.e}
MAX_EXPRESSION_CHARS = 200


def calculate(expression: str) -> float:
    """The value of an arithmetic ``expression`` (numbers, ``+ - * / // % **``, parentheses, ``pi``, ``e`` and
    the functions of :data:`_FUNCTIONS`), computed in floating point; anything else is refused. Never
    ``eval``: the text is parsed to Python's syntax tree and only whitelisted nodes are computed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolFailure(f"expression of {len(expression)} characters (at most {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except (SyntaxError, ValueError, RecursionError) as exc:
        raise ToolFailure(f"cannot read the expression ({type(exc).__name__})") from None
    try:
        value = _value(tree.body)
    except ToolFailure:
        raise
    except (ArithmeticError, ValueError) as exc:
        raise ToolFailure(f"{type(exc).__name__}: {exc}") from None
    if not math.isfinite(value):
        raise ToolFailure(f"the result is {value}")
    return value


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return float(_BINARY[type(node.op)](_value(node.left), _value(node.right)))  # floats: no huge integers
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
        and len(node.args) == 1
    ):
        return float(_FUNCTIONS[node.func.id](_value(node.args[0])))
    raise ToolFailure(f"{type(node).__name__} is not allowed (numbers, + - * / // % **, parentheses, functions)")


def calculator(ctx: ToolContext, expression: str) -> ToolResult:
    value = calculate(expression)
    text = str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.12g}"
    return ToolResult(text=text)


_IMAGE = {"type": "integer", "minimum": 1, "description": "which image (1: the first; default 1)"}
_BOX = {"type": "array", "items": {"type": "number"}, "minItems": 4, "maxItems": 4, "description": "[x0, y0, x1, y1]"}
_AREA = {"region": {"type": "string", "enum": list(REGIONS)}, "box": _BOX, "image": _IMAGE}

BUILTIN_TOOLS: dict[str, Tool] = {
    t.name: t
    for t in (
        Tool(
            "zoom",
            "Zoom into a region of an image (or a box): see it in detail.",
            {"type": "object", "properties": _AREA},
            zoom,
        ),
        Tool("crop", "Crop a region of an image (or a box in pixels).", {"type": "object", "properties": _AREA}, crop),
        Tool(
            "rotate",
            "Rotate an image counter-clockwise.",
            {"type": "object", "properties": {"degrees": {"type": "number"}, "image": _IMAGE}, "required": ["degrees"]},
            rotate,
        ),
        Tool(
            "calculator",
            "Compute an arithmetic expression, e.g. (3 + 4) * sqrt(2) / 2.",
            {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
            calculator,
        ),
    )
}
