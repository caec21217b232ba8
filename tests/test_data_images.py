"""Image loading: every image form, EXIF orientation, mode conversion, Qwen's resize, bad images."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from data_pipelines.errors import DataError
from data_pipelines.images import load_image


def png_bytes(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG", **kw)
    return buf.getvalue()


def with_png_size(data: bytes, width: int, height: int) -> bytes:
    """The PNG with its IHDR claiming another size (CRC fixed), pixels untouched: a decompression-bomb header."""
    ihdr = data[12:16] + struct.pack(">II", width, height) + data[24:29]
    return data[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + data[33:]


def gradient(w: int = 90, h: int = 60) -> Image.Image:
    x = np.linspace(0, 255, w, dtype=np.float64)[None, :, None]
    y = np.linspace(0, 255, h, dtype=np.float64)[:, None, None]
    arr = np.concatenate(
        [np.broadcast_to(x, (h, w, 1)), np.broadcast_to(y, (h, w, 1)), np.full((h, w, 1), 77.0)], axis=2
    )
    return Image.fromarray(arr.astype(np.uint8), "RGB")


def test_every_image_form_gives_the_same_rgb_pixels(tmp_path, monkeypatch):
    im = gradient()
    data = png_bytes(im)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "g.png").write_bytes(data)
    monkeypatch.chdir(tmp_path)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    forms = {
        "relative path + base_dir": ("g.png", {"base_dir": tmp_path / "sub"}),
        "relative path to cwd": ("sub/g.png", {}),
        "absolute str": (str(tmp_path / "sub" / "g.png"), {}),
        "Path": (tmp_path / "sub" / "g.png", {}),
        "file:// URI": ("file://" + str(tmp_path / "sub" / "g.png"), {}),
        "bytes": (data, {}),
        "bytearray": (bytearray(data), {}),
        "data URI": (uri, {}),
        "data URI with line breaks": (uri[:60] + "\n" + uri[60:], {}),
        "datasets feature with bytes": ({"bytes": data, "path": "ignored.png"}, {}),
        "datasets feature with path": ({"bytes": None, "path": "g.png"}, {"base_dir": tmp_path / "sub"}),
        "PIL": (im, {}),
    }
    reference = np.asarray(load_image(im))
    assert reference.shape == (56, 84, 3)  # smart_resize(60, 90) within 3136..12544 pixels
    for name, (src, kw) in forms.items():
        out = load_image(src, **kw)
        assert out.mode == "RGB", name
        np.testing.assert_array_equal(np.asarray(out), reference, err_msg=name)


def test_exif_orientation_is_applied(tmp_path):
    im = Image.new("RGB", (80, 40), (255, 0, 0))
    im.paste((0, 0, 255), (40, 0, 80, 40))  # left red, right blue
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: display turns it 90 degrees clockwise
    path = tmp_path / "rot.png"
    im.save(path, exif=exif)
    out = load_image(path, max_pixels=None)
    assert out.size == (40, 80)
    assert out.getpixel((20, 5)) == (255, 0, 0) and out.getpixel((20, 75)) == (0, 0, 255)


@pytest.mark.parametrize(
    "mode,make,expect",
    [
        ("RGBA transparent", lambda: Image.new("RGBA", (56, 56), (10, 20, 30, 0)), (255, 255, 255)),
        ("RGBA opaque", lambda: Image.new("RGBA", (56, 56), (10, 20, 30, 255)), (10, 20, 30)),
        ("LA half", lambda: Image.new("LA", (56, 56), (0, 128)), (127, 127, 127)),
        ("L", lambda: Image.new("L", (56, 56), 200), (200, 200, 200)),
        ("1", lambda: Image.new("1", (56, 56), 1), (255, 255, 255)),
        (
            "P",
            lambda: Image.new("RGB", (56, 56), (0, 200, 0)).convert("P", palette=Image.Palette.ADAPTIVE),
            (0, 200, 0),
        ),
        ("CMYK", lambda: Image.new("CMYK", (56, 56), (0, 255, 255, 0)), (255, 0, 0)),
        ("I;16", lambda: Image.fromarray(np.full((56, 56), 32896, np.uint16)), (128, 128, 128)),
        ("I", lambda: Image.fromarray(np.full((56, 56), 65535, np.int32), "I"), (255, 255, 255)),
        ("F", lambda: Image.fromarray(np.full((56, 56), 99.6, np.float32), "F"), (100, 100, 100)),
    ],
)
def test_modes_convert_to_rgb(tmp_path, mode, make, expect):
    im = make()
    fmt = "TIFF" if im.mode in ("CMYK", "I", "F") else "PNG"
    path = tmp_path / f"img.{fmt.lower()}"
    im.save(path, format=fmt)
    for src in (path, im):  # from a file and in memory
        out = load_image(src)
        assert out.mode == "RGB" and out.size == (56, 56)
        assert np.abs(np.asarray(out).astype(int) - expect).max() <= 1, (mode, out.getpixel((0, 0)))


def test_palette_with_transparency_goes_onto_white():
    im = Image.new("P", (56, 56), 0)
    im.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    im.paste(1, (0, 0, 28, 56))
    im.info["transparency"] = 0
    out = load_image(Image.open(io.BytesIO(png_bytes(im, transparency=0))))
    assert out.getpixel((5, 5)) == (255, 0, 0) and out.getpixel((50, 5)) == (255, 255, 255)


@pytest.mark.parametrize("size", [(56, 56), (1, 1), (28, 2000), (1000, 700), (113, 57), (300, 300)])
def test_resize_is_transformers_smart_resize_within_bounds(size):
    w, h = size
    out = load_image(Image.new("RGB", (w, h), (1, 2, 3)), min_pixels=3136, max_pixels=12544)
    assert out.size[0] % 28 == 0 and out.size[1] % 28 == 0
    if min(out.size) > 28:  # a side clamped at 28 may exceed max_pixels, in transformers as here
        assert 3136 <= out.size[0] * out.size[1] <= 12544
    assert out.size[::-1] == smart_resize(h, w, factor=28, min_pixels=3136, max_pixels=12544)
    big = load_image(Image.new("RGB", (w, h)), min_pixels=3136, max_pixels=1003520)
    assert big.size[::-1] == smart_resize(h, w, factor=28, min_pixels=3136, max_pixels=1003520)


def test_qwen_vl_utils_agrees_where_it_imports():
    try:
        from qwen_vl_utils import smart_resize as qwen_smart_resize
    except Exception:  # noqa: BLE001 - imports torchvision, which has no CPU build
        pytest.skip("qwen_vl_utils does not import here (no torchvision)")
    for h, w in [(60, 90), (1000, 700), (28, 2000)]:
        assert qwen_smart_resize(h, w, 28, 3136, 12544) == smart_resize(h, w, 28, 3136, 12544)


@pytest.mark.timeout(20)
def test_decompression_bomb_is_refused_before_decoding(tmp_path):
    bomb = with_png_size(png_bytes(Image.new("RGB", (1, 1))), 100_000, 100_000)  # 10 G pixels claimed, 70 bytes
    (tmp_path / "bomb.png").write_bytes(bomb)
    for src in (bomb, tmp_path / "bomb.png"):
        with pytest.raises(DataError, match=r"too large") as info:
            load_image(src)
        assert info.value.category == "image too large"
    below_pil = with_png_size(png_bytes(Image.new("RGB", (1, 1))), 5000, 5000)  # under PIL's own limit, over ours
    with pytest.raises(DataError, match=r"5000x5000 = 25000000 pixels > max_image_pixels 1000000"):
        load_image(below_pil, max_image_pixels=1_000_000)


@pytest.mark.timeout(20)
def test_bad_images_raise_data_error_with_reason(tmp_path):
    data = png_bytes(gradient(200, 200))
    jpeg = io.BytesIO()
    gradient(200, 200).save(jpeg, format="JPEG")
    cases = {
        "truncated PNG": (data[: len(data) // 2], "truncated image", r"^truncated PNG \("),
        "truncated JPEG": (jpeg.getvalue()[: len(jpeg.getvalue()) // 2], "truncated image", r"^truncated JPEG \("),
        "garbage": (b"this is not an image at all" * 10, "corrupt image", r"not a readable image"),
        "zero bytes": (b"", "empty file", r"empty image bytes"),
        "missing file": (str(tmp_path / "nope.png"), "missing file", r"file not found: .*nope\.png"),
        "a folder": (str(tmp_path), "missing file", r"is a directory"),
        "bad base64": ("data:image/png;base64,@@@not-base64@@@", "bad base64", r"bad base64"),
        "not base64": ("data:image/png,rawtext", "bad base64", r"not base64"),
        "URL": ("https://example.com/cat.png", "unsupported image", r"not fetched"),
        "int": (42, "wrong type", r"wrong type for an image: int"),
        "empty dict": ({"bytes": None, "path": None}, "wrong type", r"neither 'bytes' nor 'path'"),
        "aspect 1:500": (png_bytes(Image.new("RGB", (1, 500))), "bad image size", r"aspect ratio"),
    }
    (tmp_path / "empty.png").write_bytes(b"")
    cases["zero-byte file"] = (tmp_path / "empty.png", "empty file", r"empty file \(0 bytes\)")
    for name, (src, category, pattern) in cases.items():
        with pytest.raises(DataError, match=pattern) as info:
            load_image(src)
        assert info.value.category == category, name
