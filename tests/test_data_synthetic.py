"""Synthetic visual tasks: deterministic, exact answers checked from the pixels, pairs, judgments, round trip."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from data_pipelines.drawing import COLORS, SHAPES
from data_pipelines.formatting import (
    JUDGE_SYSTEM_PROMPT,
    PAIRWISE_JUDGE_SYSTEM_PROMPT,
    judgment_as_prompt,
    judgment_prompt,
)
from data_pipelines.readers import read_records
from data_pipelines.synthetic import (
    make_judgment_records,
    make_preference_pairs,
    make_prompt_records,
    write_prompt_records,
)
from reward_models.generative import parse_judgment

TASK_OPTIONS = [
    ("color", {}),
    ("color", {"mode": "object", "noise": 8}),
    ("yes_no", {"noise": 8}),
    ("yes_no", {"num_colors": 2, "paired": True}),
    ("shape", {"num_shapes": 8, "rotate": True}),
    ("count_shapes", {"distractors": 3}),
    ("triangle_angle", {"angle_step": 1, "side_labels": True}),
]


@pytest.mark.parametrize("task,options", TASK_OPTIONS)
def test_same_seed_same_records_other_seed_other_records(task, options):
    a, b = make_prompt_records(task, 12, seed=3, **options), make_prompt_records(task, 12, seed=3, **options)
    assert [(r.id, r.prompt, r.answer, r.metadata) for r in a] == [(r.id, r.prompt, r.answer, r.metadata) for r in b]
    assert all(x.images[0].tobytes() == y.images[0].tobytes() for x, y in zip(a, b))
    c = make_prompt_records(task, 12, seed=4, **options)
    assert any(x.images[0].tobytes() != y.images[0].tobytes() for x, y in zip(a, c))
    for rec in a:
        assert rec.task == task and rec.images[0].mode == "RGB" and len(rec.images) == 1
        assert rec.answer == rec.metadata["ground_truth"] and rec.answer in rec.metadata["vocabulary"]


def test_color_images_have_the_named_colour_and_labels_are_balanced():
    records = make_prompt_records("color", 40, seed=0)
    assert records[0].prompt == "What colour is this image? Answer with one word."
    assert records[0].images[0].size == (56, 56)  # 4 image tokens for Qwen-VL
    for rec in records:
        assert (np.asarray(rec.images[0]) == COLORS[rec.answer]).all()
    assert Counter(r.answer for r in records) == {"red": 10, "green": 10, "blue": 10, "yellow": 10}
    eight = make_prompt_records("color", 16, seed=0, num_colors=8)
    assert (
        sorted(set(r.answer for r in eight)) == sorted(list(COLORS)[:8])
        and eight[0].metadata["vocabulary"] == list(COLORS)[:8]
    )
    chosen = make_prompt_records("color", 8, seed=0, colors=["red", "green", "brown", "pink"])
    assert Counter(r.answer for r in chosen) == {"red": 2, "green": 2, "brown": 2, "pink": 2}
    assert all((np.asarray(r.images[0]) == COLORS[r.answer]).all() for r in chosen)
    with pytest.raises(ValueError, match=r"colors must be 2\+ distinct names"):
        make_prompt_records("color", 1, colors=["red", "teal"])
    two = make_prompt_records("color", 6, seed=0, num_colors=2)
    assert Counter(r.answer for r in two) == {"red": 3, "green": 3}
    with pytest.raises(ValueError, match="num_colors must be in 2..8"):
        make_prompt_records("color", 1, num_colors=9)


def test_yes_no_answers_are_right_and_balanced_so_one_word_scores_half():
    records = make_prompt_records("yes_no", 40, seed=0)
    for rec in records:
        asked = rec.prompt.removeprefix("Is this image ").removesuffix("? Answer yes or no.")
        assert asked == rec.metadata["asked"] and (np.asarray(rec.images[0]) == COLORS[rec.metadata["color"]]).all()
        assert rec.answer == ("yes" if asked == rec.metadata["color"] else "no")
        assert rec.metadata["vocabulary"] == ["yes", "no"]
    assert Counter(r.answer for r in records) == {"yes": 20, "no": 20}
    assert Counter(r.metadata["color"] for r in records) == {"red": 10, "green": 10, "blue": 10, "yellow": 10}
    paired = make_prompt_records("yes_no", 8, seed=0, num_colors=2, paired=True)
    assert [r.answer for r in paired] == ["yes", "no"] * 4  # each image asked both questions, side by side
    assert all(a.images[0] is b.images[0] for a, b in zip(paired[::2], paired[1::2]))
    with pytest.raises(ValueError, match="question must contain"):
        make_prompt_records("yes_no", 2, question="Is it?")


def test_random_answers_are_coin_flips_of_the_vocabulary_and_what_is_made_from_them_follows():
    """data.synthetic_options.random_answers (a format-only warm start's data): each answer a uniform draw from the
    record's vocabulary, independent of the truth (kept as true_answer), the same for the same seed; pairs and
    judgments are made from the drawn answer."""
    options = {"num_colors": 2, "paired": True}
    true = make_prompt_records("yes_no", 1024, seed=3, **options)
    drawn = make_prompt_records("yes_no", 1024, seed=3, random_answers=True, **options)
    assert [r.images[0].tobytes() for r in drawn[:8]] == [r.images[0].tobytes() for r in true[:8]]  # same drawings
    assert [r.metadata["true_answer"] for r in drawn] == [r.answer for r in true]
    assert all(r.answer in ("yes", "no") and r.metadata["ground_truth"] == r.answer for r in drawn)
    agree = sum(d.answer == t.answer for d, t in zip(drawn, true)) / len(true)
    # independent of the truth: agreement 0.5 +- 3.3 standard deviations (sqrt(0.25 / 1024) = 0.0156); measured 0.48
    assert abs(agree - 0.5) < 0.052, agree
    assert abs(Counter(r.answer for r in drawn)["yes"] / 1024 - 0.5) < 0.052
    again = make_prompt_records("yes_no", 1024, seed=3, random_answers=True, **options)
    assert [r.answer for r in again] == [r.answer for r in drawn]
    colours = make_prompt_records("color", 200, seed=0, random_answers=True)
    assert (
        set(r.answer for r in colours) <= set(colours[0].metadata["vocabulary"])
        and len({r.answer for r in colours}) > 2
    )
    pairs = make_preference_pairs("color", 8, seed=0, random_answers=True)
    assert [p.chosen for p in pairs] == [r.answer for r in make_prompt_records("color", 8, 0, random_answers=True)]
    judged = make_judgment_records("yes_no", 8, seed=0, paired=True, random_answers=True, num_colors=2)
    firsts = make_prompt_records("yes_no", 4, seed=0, random_answers=True, num_colors=2)
    assert [j.metadata["candidate"] for j in judged[::2]] == [r.answer for r in firsts]  # the drawn answer: "right"
    assert [j.target for j in judged[:2]] == ["<answer>yes</answer>", "<answer>no</answer>"]
    with pytest.raises(ValueError, match="random_answers must be true or false, got 'yes'"):
        make_prompt_records("color", 2, random_answers="yes")


def test_color_object_mode_shape_has_the_named_colour():
    for rec in make_prompt_records("color", 16, seed=1, mode="object", image_size=112):
        pixels = Counter(map(tuple, np.asarray(rec.images[0]).reshape(-1, 3).tolist()))
        (bg, _), (fg, n) = pixels.most_common(2)
        assert bg == (128, 128, 128) and fg == COLORS[rec.answer] and n > 300


def fill_ratio(img) -> float:
    """Share of the non-white bounding box that the shape covers (circle ~pi/4, square 1, triangle ~1/2 ...)."""
    mask = (np.asarray(img) != 255).any(axis=2)
    ys, xs = np.nonzero(mask)
    return mask.sum() / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))


def test_shape_answers_match_the_drawn_shape():
    expected = {"circle": (0.74, 0.84), "square": (0.97, 1.0), "triangle": (0.45, 0.58), "star": (0.3, 0.45)}
    records = make_prompt_records("shape", 24, seed=2)
    assert Counter(r.answer for r in records) == {s: 6 for s in SHAPES[:4]}
    for rec in records:
        lo, hi = expected[rec.answer]
        assert lo <= fill_ratio(rec.images[0]) <= hi, (rec.answer, fill_ratio(rec.images[0]))


def components(img) -> int:
    """Connected non-white regions (4-neighbour flood fill)."""
    mask = (np.asarray(img) != 255).any(axis=2)
    seen = np.zeros_like(mask)
    h, w = mask.shape
    n = 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        n += 1
        stack = [(y0, x0)]
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            for yy, xx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= yy < h and 0 <= xx < w and mask[yy, xx] and not seen[yy, xx]:
                    seen[yy, xx] = True
                    stack.append((yy, xx))
    return n


def test_count_shapes_answer_equals_the_shapes_drawn():
    records = make_prompt_records("count_shapes", 15, seed=5, max_count=5, distractors=2)
    assert Counter(r.answer for r in records) == {str(k): 3 for k in range(1, 6)}
    for rec in records:
        assert components(rec.images[0]) == int(rec.answer) + 2
        assert rec.prompt == "How many circles are in the image? Answer with a number."
    with pytest.raises(ValueError, match="do not fit"):
        make_prompt_records("count_shapes", 1, max_count=30, image_size=56)


def test_triangle_angle_answer_is_180_minus_the_labelled_angles():
    for step in (10, 1):
        for rec in make_prompt_records("triangle_angle", 20, seed=6, angle_step=step):
            angles, unknown = rec.metadata["angles"], rec.metadata["unknown_vertex"]
            assert sum(angles) == 180 and all(a >= 20 and a % step == 0 for a in angles)
            assert int(rec.answer) == 180 - sum(a for k, a in enumerate(angles) if k != unknown)
            assert components(rec.images[0]) >= 3  # the outline and its labels


def test_triangle_geometry_has_the_stated_angles():
    import random

    from data_pipelines.drawing import triangle_vertices as _triangle

    for angles in ([30, 60, 90], [20, 20, 140], [71, 52, 57]):
        v = _triangle(angles, 224, random.Random(0))
        for k in range(3):
            a, b, c = np.array(v[k]), np.array(v[(k + 1) % 3]), np.array(v[(k + 2) % 3])
            cos = (b - a) @ (c - a) / (np.linalg.norm(b - a) * np.linalg.norm(c - a))
            assert math.degrees(math.acos(cos)) == pytest.approx(angles[k], abs=1e-9)
        assert all(0 <= x <= 224 and 0 <= y <= 224 for x, y in v)


@pytest.mark.parametrize("task", ["color", "shape", "count_shapes", "triangle_angle"])
def test_preference_pairs_prefer_the_right_answer(task):
    pairs = make_preference_pairs(task, 10, seed=1, response_template="<answer>{answer}</answer>")
    records = make_prompt_records(task, 10, seed=1)
    for pair, rec in zip(pairs, records):
        assert pair.chosen == f"<answer>{rec.answer}</answer>" and pair.rejected != pair.chosen
        assert (
            pair.metadata["wrong_answer"] in rec.metadata["vocabulary"] and pair.metadata["wrong_answer"] != rec.answer
        )
        assert pair.images[0].tobytes() == rec.images[0].tobytes()


# a judge layout of one's own (the pool's judge_template / judge_system_prompt would match it)
INLINE_JUDGE = (
    "<image>Question: {prompt}\nCandidate answer: {response}\n"
    "Is the candidate answer correct? Answer with <answer>yes</answer> or <answer>no</answer>."
)


def test_judgment_records_pointwise_and_pairwise():
    point = make_judgment_records("color", 10, seed=0, judge_template=INLINE_JUDGE, judge_system_prompt="")
    assert Counter(j.target for j in point) == {"<answer>yes</answer>": 5, "<answer>no</answer>": 5}
    for j in point:
        right = j.metadata["candidate"] == j.metadata["ground_truth"]
        assert j.target == ("<answer>yes</answer>" if right else "<answer>no</answer>")
        assert j.prompt.startswith("<image>Question: What colour is this image?") and len(j.images) == 1
        assert f"Candidate answer: {j.metadata['candidate']}\n" in j.prompt
    pair = make_judgment_records("count_shapes", 10, seed=0, judge_mode="pairwise")
    assert Counter(j.target for j in pair) == {"<answer>A</answer>": 5, "<answer>B</answer>": 5}
    for j in pair:
        right = "A" if j.metadata["answer_a"] == j.metadata["ground_truth"] else "B"
        assert j.target == f"<answer>{right}</answer>" and f"Response A: {j.metadata['answer_a']}\n" in j.prompt
        assert j.system == PAIRWISE_JUDGE_SYSTEM_PROMPT


def test_judgment_records_with_a_rationale_state_the_reference_answer_before_the_verdict():
    """``rationale=True`` (the pairwise colour judge's recipe): the target solves, then judges; the verdict and the
    records are those without it."""
    for mode, paired in (("pairwise", True), ("pairwise", False), ("pointwise", False), ("pointwise", True)):
        plain = make_judgment_records("color", 8, seed=1, judge_mode=mode, paired=paired, num_colors=2)
        why = make_judgment_records("color", 8, seed=1, judge_mode=mode, paired=paired, num_colors=2, rationale=True)
        assert [j.prompt for j in why] == [j.prompt for j in plain] and len(why) == 8
        for j, p in zip(why, plain):
            assert j.target == f"The answer is {j.metadata['ground_truth']}. {p.target}"
            assert judgment_as_prompt(j).answer == judgment_as_prompt(p).answer  # the verdict RL rewards


def test_pointwise_judgments_are_in_the_pools_judge_format():
    """By default the pool's judge prompt (system turn + question and candidate), as the pool asks the judge;
    paired: each prompt's right then wrong candidate; task options (the colour task's own mode) pass through."""
    prompts = make_prompt_records("color", 4, seed=3, mode="object")
    paired = make_judgment_records("color", 8, seed=3, paired=True, mode="object")
    assert [j.metadata["verdict"] for j in paired] == ["yes", "no"] * 4
    for k, j in enumerate(paired):
        rec = prompts[k // 2]
        assert j.system == JUDGE_SYSTEM_PROMPT and j.prompt == judgment_prompt(rec.prompt, j.metadata["candidate"])
        assert (j.metadata["candidate"] == rec.answer) == (k % 2 == 0) and j.images[0].tobytes() == rec.images[
            0
        ].tobytes()
    alternating = make_judgment_records("color", 4, seed=3, mode="object")
    assert [j.target for j in alternating] == ["<answer>yes</answer>", "<answer>no</answer>"] * 2
    assert [parse_judgment(j.target) for j in alternating] == [1.0, 0.0, 1.0, 0.0]


def test_written_records_read_back_pixel_for_pixel(tmp_path):
    records = make_prompt_records("count_shapes", 5, seed=9) + make_prompt_records("color", 4, seed=9)
    out = write_prompt_records(records, tmp_path / "syn" / "train.jsonl")
    assert sorted(p.name for p in (tmp_path / "syn" / "train_images").iterdir())[0] == "000000_count_shapes-9-0_0.png"
    back, report = read_records(out, max_pixels=None)
    assert report.skipped == 0 and [r.answer for r in back] == [r.answer for r in records]
    assert [r.task for r in back] == [r.task for r in records] and back[0].metadata == records[0].metadata
    assert all(np.array_equal(np.asarray(a.images[0]), np.asarray(b.images[0])) for a, b in zip(back, records))
    pairs = make_preference_pairs("shape", 3, seed=9)
    out = write_prompt_records(pairs, tmp_path / "pairs.jsonl")
    back, _ = read_records(out, kind="preference")
    assert [(p.chosen, p.rejected) for p in back] == [(p.chosen, p.rejected) for p in pairs]


def test_mark_color_without_the_cue_hides_where_the_mark_is_once_shrunk():
    """``cue=False`` (docs/tools.md): a mid-grey background, so that at half resolution (what the model is shown)
    no quadrant differs from another and the mark does not show; with the cue, the mark's quadrant is the lighter
    one. The mark itself is the same checkerboard, at the same place, for the same seed."""
    from PIL import Image

    from data_pipelines.synthetic_tasks import QUADRANTS

    records = {cue: make_prompt_records("mark_color", 4, seed=0, image_size=256, cue=cue) for cue in (True, False)}
    for cue, rows in records.items():
        for r in rows:
            small = np.asarray(r.images[0].resize((128, 128), Image.BILINEAR), dtype=np.float64)
            means = [small[y : y + 64, x : x + 64].mean() for y in (0, 64) for x in (0, 64)]
            mark = QUADRANTS.index(r.metadata["region"])
            if cue:
                assert means[mark] > max(m for i, m in enumerate(means) if i != mark) + 100, means
            else:  # measured: every pixel of the shrunk image within 2 of 128
                assert max(means) - min(means) < 1.0 and np.abs(small - 128).max() <= 3, means
            x0, y0, _, _ = r.metadata["box"]
            full = np.asarray(r.images[0], dtype=np.int16)
            assert (full[y0, x0] == COLORS[r.answer]).all() and (full[y0, x0 + 1] == 255 - full[y0, x0]).all()
    same = [(r.answer, r.metadata) for r in records[True]] == [(r.answer, r.metadata) for r in records[False]]
    assert same
