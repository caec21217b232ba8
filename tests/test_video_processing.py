"""The torchvision-free video path (data_pipelines.video) on real files written with PyAV, and the dot-motion task."""

from __future__ import annotations

import av
import numpy as np
import pytest
from PIL import Image

from data_pipelines.errors import DataError
from data_pipelines.synthetic_video import dot_frames, make_dot_motion_records, write_video
from data_pipelines.video import (
    QwenVideoProcessor,
    frame_size,
    grid_timestamps,
    iter_frames,
    load_video,
    probe_video,
    sample_indices,
)
from vlrft.models.loading import load_processor
from vlrft.models.processing import torchvision_available

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
TINY = {"min_pixels": 4 * 28 * 28, "max_pixels": 16 * 28 * 28}  # 56x56 frames: 4x4 patches of 14


def _moving_dot(size=(64, 48), frames=30):
    w, h = size
    out = []
    for k in range(frames):
        a = np.full((h, w, 3), 128, np.uint8)
        a[h // 2 - 4 : h // 2 + 4, k : k + 8] = (220, 30, 30)
        out.append(Image.fromarray(a))
    return out


@pytest.fixture(scope="module")
def mp4(tmp_path_factory):
    """3 s of 64x48 at 10 fps (30 frames), a red dot moving right."""
    return write_video(_moving_dot(), tmp_path_factory.mktemp("video") / "dot.mp4", fps=10)


def test_probe_reads_frames_rate_and_size(mp4, tmp_path):
    info = probe_video(mp4)
    assert (info.total_frames, info.fps, info.width, info.height, info.duration) == (30, 10.0, 64, 48, 3.0)
    gif = write_video(_moving_dot(frames=12), tmp_path / "dot.gif", fps=10, codec="gif")
    assert (probe_video(gif).total_frames, probe_video(gif).fps) == (12, 10.0)


@pytest.mark.parametrize(
    "total, video_fps, kw, expected",
    [
        (30, 10, {}, [0, 6, 12, 17, 23, 29]),  # 3 s * 2 fps = 6; linspace(0, 29, 6) = 0, 5.8, 11.6, 17.4, 23.2, 29
        (30, 10, {"fps": 2.5}, [0, 6, 12, 17, 23, 29]),  # 7.5 frames, rounded down to the temporal patch: 6
        (30, 10, {"fps": 4, "max_frames": 5}, [0, 10, 19, 29]),  # 12 capped at floor2(5) = 4
        (30, 10, {"fps": 1}, [0, 10, 19, 29]),  # 3 raised to min_frames 4
        (3, 10, {}, [0, 2]),  # 0.6 -> min 4 -> capped by floor2(3) = 2
    ],
)
def test_sample_indices_follow_qwen_rules(total, video_fps, kw, expected):
    assert sample_indices(total, video_fps, **kw) == expected


def test_sample_indices_refuse_a_one_frame_video():
    with pytest.raises(ValueError, match="1 frame\\(s\\) at max_frames 768 give 0 sampled frames"):
        sample_indices(1, 10)


@pytest.mark.parametrize(
    "args, kw, expected",
    [
        ((48, 64, 6), {"factor": 28, **TINY}, (56, 56)),
        ((336, 448, 6), {"factor": 28, "min_pixels": 3136}, (336, 448)),  # under 768 tokens a frame: kept
        # budget 150528 px over 6 frames: 50176 px a frame; beta = sqrt(336*448/50176) = sqrt(3) -> 168 x 252
        ((336, 448, 6), {"factor": 28, "min_pixels": 3136, "total_pixels": 150528}, (168, 252)),
        # Qwen3-VL (factor 32), default min 128 tokens: round(10.5) = 10 -> 320, 14 -> 448; 143360 >= 131072
        ((336, 448, 6), {"factor": 32}, (320, 448)),
    ],
)
def test_frame_size_hand_computed(args, kw, expected):
    assert frame_size(*args, **kw) == expected


def _reference_rows(frames_u8, mean, std, patch=14, merge=2, tp=2):
    """transformers' Qwen2VLVideoProcessor.patchify written out element by element, float64."""
    x = (np.asarray(frames_u8, np.float64) / 255.0 - np.asarray(mean)) / np.asarray(std)  # [T, H, W, C]
    t, h, w, c = x.shape
    gh, gw = h // patch, w // patch
    rows = []
    for g in range(t // tp):
        for bh in range(gh // merge):
            for bw in range(gw // merge):
                for mh in range(merge):
                    for mw in range(merge):
                        py, px = (bh * merge + mh) * patch, (bw * merge + mw) * patch
                        rows.append(
                            [
                                x[g * tp + f, py + i, px + j, ch]
                                for ch in range(c)
                                for f in range(tp)
                                for i in range(patch)
                                for j in range(patch)
                            ]
                        )
    return np.asarray(rows)


def test_pixel_values_match_the_reference_layout(tmp_path):
    path = write_video(_moving_dot(size=(56, 56), frames=20), tmp_path / "dot56.mp4", fps=10)  # 2 s: 4 frames
    vp = QwenVideoProcessor(
        patch_size=14, merge_size=2, temporal_patch_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD, **TINY
    )
    out = vp([str(path)])
    with av.open(str(path)) as c:
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    expected = _reference_rows([decoded[i] for i in (0, 6, 13, 19)], CLIP_MEAN, CLIP_STD)
    assert out["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert out["pixel_values_videos"].shape == (32, 1176) == expected.shape
    assert np.abs(out["pixel_values_videos"] - expected).max() < 1e-5
    assert out["video_metadata"][0].frames_indices == [0, 6, 13, 19]


def test_frame_list_is_one_video_padded_to_the_temporal_patch(tmp_path):
    paths = []
    for k, im in enumerate(_moving_dot(size=(56, 56), frames=3)):
        im.save(tmp_path / f"f{k}.png")
        paths.append(str(tmp_path / f"f{k}.png"))
    video = load_video(paths, factor=28, **TINY)
    assert video.indices == [0, 1, 2, 2] and video.frames[3].tobytes() == video.frames[2].tobytes()
    vp = QwenVideoProcessor(
        patch_size=14, merge_size=2, temporal_patch_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD, **TINY
    )
    out = vp([[paths]])  # transformers' form of one video given as frame paths
    expected = _reference_rows([np.asarray(Image.open(p)) for p in paths + paths[-1:]], CLIP_MEAN, CLIP_STD)
    assert out["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert np.abs(out["pixel_values_videos"] - expected).max() < 1e-5


def test_timing_inputs_of_each_family(mp4, tiny_model):
    # 6 frames of 30 at 10 fps: sampled at 2 fps, so a temporal grid (2 frames) spans 1 s
    assert load_video(mp4, factor=28, **TINY).second_per_grid == 1.0
    # frames 0,6 | 12,17 | 23,29 at 10 fps: (0 + 0.6) / 2, (1.2 + 1.7) / 2, (2.3 + 2.9) / 2
    assert np.allclose(grid_timestamps([0, 6, 12, 17, 23, 29], 10.0), [0.3, 1.45, 2.6])
    text = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Which way?<|im_end|>\n"
    proc = load_processor(tiny_model("qwen2_5_vl"))
    out = proc(text=[text], videos=[str(mp4)], videos_kwargs=TINY, return_tensors="pt")
    assert out["video_grid_thw"].tolist() == [[3, 4, 4]] and out["second_per_grid_ts"].tolist() == [1.0]
    assert (out["input_ids"][0] == proc.video_token_id).sum().item() == 3 * 4 * 4 // 4
    proc3 = load_processor(tiny_model("qwen3_vl"))
    out3 = proc3(text=[text], videos=[str(mp4)], videos_kwargs=TINY, return_tensors="pt")
    decoded = proc3.tokenizer.decode(out3["input_ids"][0])
    assert [decoded.count(f"<{t} seconds>") for t in ("0.3", "1.4", "2.6")] == [1, 1, 1]
    assert out3["video_grid_thw"].tolist() == [[3, 4, 4]]  # factor 32: 64x48 -> 64x64 (min 4 tokens of 32x32)


def test_unknown_setting_is_refused(mp4):
    vp = QwenVideoProcessor(
        patch_size=14, merge_size=2, temporal_patch_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD
    )
    with pytest.raises(TypeError, match="QwenVideoProcessor takes no max_fps; its settings: fps, min_frames"):
        vp([str(mp4)], max_fps=3)


def test_bad_files_are_one_line_naming_the_file(mp4, tmp_path):
    text = tmp_path / "notes.mp4"
    text.write_text("not a video")
    with pytest.raises(DataError) as err:
        load_video(text, factor=28)
    assert str(err.value).startswith("not a readable video (") and str(err.value).endswith(f": {text}")
    empty = tmp_path / "empty.mp4"
    with av.open(str(empty), "w") as c:
        s = c.add_stream("libx264", rate=10)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        c.start_encoding()
    with pytest.raises(DataError) as err:
        load_video(empty, factor=28)
    assert str(err.value) == f"video has no frames (no video stream): {empty}"
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(mp4.read_bytes()[: mp4.stat().st_size // 2])
    with pytest.raises(DataError) as err:
        load_video(cut, factor=28)
    assert str(cut) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(DataError, match="file not found: .*missing.mp4"):
        load_video(tmp_path / "missing.mp4", factor=28)


def test_iter_frames_yields_only_the_wanted_frames_lazily(mp4):
    frames = iter_frames(mp4, [0, 29])
    assert not isinstance(frames, list)
    got = [np.asarray(im) for im in frames]
    centre = [np.argmax(a[24, :, 0].astype(int) - a[24, :, 1]) for a in got]  # red column: where the dot is
    assert len(got) == 2 and centre[0] < 8 <= 29 <= centre[1]


@pytest.mark.skipif(not torchvision_available(), reason="torchvision absent: compared with the hand reference instead")
def test_equal_to_transformers_video_processor(mp4):
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    video = load_video(mp4, factor=28, **TINY)
    frames = np.stack([np.asarray(im) for im in video.frames])
    ours = QwenVideoProcessor(
        patch_size=14, merge_size=2, temporal_patch_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD, **TINY
    )
    theirs = Qwen2VLVideoProcessor(do_resize=False, do_sample_frames=False)(videos=[frames], return_tensors="np")
    a = ours([frames])
    assert a["video_grid_thw"].tolist() == theirs["video_grid_thw"].tolist()
    assert np.abs(a["pixel_values_videos"] - theirs["pixel_values_videos"]).max() < 1e-5


def test_dot_motion_first_frame_cannot_answer_two_frames_can(tmp_path):
    start = (30.0, 20.0)
    left, right = (dot_frames(start, "red", d, frames=8, step=3, size=64, radius=5) for d in ("left", "right"))
    assert left[0].tobytes() == right[0].tobytes() and left[1].tobytes() != right[1].tobytes()
    records = make_dot_motion_records(8, tmp_path, seed=1)
    assert sorted(r["answer"] for r in records) == ["left"] * 4 + ["right"] * 4
    assert make_dot_motion_records(8, tmp_path / "again", seed=1)[3]["metadata"] == records[3]["metadata"]
    for rec in records:
        a, b = (np.asarray(im, np.float64) for im in iter_frames(rec["videos"][0], [0, 1]))
        xs = np.arange(64)
        cx = [(np.abs(f - 128).sum(axis=(0, 2)) * xs).sum() / np.abs(f - 128).sum() for f in (a, b)]
        assert ("right" if cx[1] > cx[0] else "left") == rec["answer"], rec["id"]
        assert rec["prompt"].startswith("<video>") and probe_video(rec["videos"][0]).total_frames == 8
    gif = make_dot_motion_records(2, tmp_path / "gif", seed=2, ext="gif")[0]
    assert load_video(gif["videos"][0], factor=28, **TINY).indices == [0, 2, 5, 7]  # 2 s at 4 fps: 4 frames of 8
