"""Preference benchmarks: VL-RewardBench and Multimodal RewardBench layouts read from fixtures the tests
write (embedded and path images), hand-computed accuracies with each benchmark's tie rule, pairwise verdict
parsing and position-bias figures, and `vlrft eval-reward-model --benchmark` end to end (SRM, pairwise
judge, HTML report with images)."""

from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from data_pipelines.drawing import COLORS
from data_pipelines.preference_benchmarks import TIE_CREDIT, read_preference_benchmark
from data_pipelines.synthetic import make_preference_pairs
from data_pipelines.writers import write_records
from eval.reward_benchmarks import benchmark_metrics, evaluate_benchmark
from reward_models.judgments import (
    position_bias,
    preference,
    read_verdict,
    swap_debiased,
    win_rates,
)
from reward_models.scalar import ScalarRewardModel, score_responses
from vlrft.cli import main
from vlrft.models.loading import load_processor

REPO = Path(__file__).resolve().parents[1]


def _png(color: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), COLORS[color]).save(buf, format="PNG")
    return buf.getvalue()


# (id, query_source, human_ranking) of six VL-RewardBench items (real ids: their prefix names the subset);
# the last is a gold tie (equal ranks)
VLRB = [("hallucination_pair-1003", "POVID_preference_data_for_VLLMs", [0, 1]), ("RLAIF-V-14", "COCO", [0, 1])]
VLRB += [("wildvision-battle-13", "wildvision-battle", [1, 0]), ("mathverse_1294", None, [1, 0])]
VLRB += [("mathverse_3324", None, [1, 0]), ("LRVInstruction-000000007746", "LRVInstruction", [1, 1])]
# Better of five Multimodal RewardBench items
MMRB = ["Output1", "Output1", "Output1", "Output2", "Output2"]


def write_vlrb(tmp_path):
    """A Parquet export of the hub dataset: images embedded as {bytes, path} dicts."""
    rows = {
        "id": [i for i, _, _ in VLRB],
        "query": ["What colour is this image?"] * len(VLRB),
        "image": [{"bytes": _png(c), "path": None} for c in ["red", "green", "blue", "red", "green", "blue"]],
        "response": [[f"first {i}", f"second {i}"] for i in range(len(VLRB))],
        "human_ranking": [r for _, _, r in VLRB],
        "ground_truth": ["red"] * len(VLRB),
        "query_source": [s for _, s, _ in VLRB],
    }
    path = tmp_path / "vlrb" / "test-00000-of-00001.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table(rows), path)
    return path


def write_mmrb(tmp_path):
    """all_data.json with images as paths relative to the file, and one as plain base64 text; two reasoning
    items (mathvista: reasoning/math) and three safety items (PAIRS: safety/bias)."""
    root = tmp_path / "mmrb"
    (root / "images").mkdir(parents=True)
    rows = []
    for i, better in enumerate(MMRB):
        image: str
        if i == 4:
            image = base64.b64encode(_png("yellow")).decode()
        else:
            (root / "images" / f"{i}.png").write_bytes(_png(["red", "green", "blue", "purple"][i]))
            image = f"images/{i}.png"
        category, dataset = ("reasoning", "mathvista") if i < 2 else ("safety", "pairs")
        rows.append(
            {"ID": f"{dataset}_{i}", "Text": "Name the colour.", "Image": image, "Output1": f"one {i}"}
            | {"Output2": f"two {i}", "Better": better, "Category": category}
        )
    (root / "all_data.json").write_text(json.dumps(rows))
    return root / "all_data.json"


def _prefs(pairs, verdicts):
    """A pairwise judge's verdicts in the benchmark's order, as the preference for each chosen response."""
    return [preference(v) if p.metadata["first_is_chosen"] else 1.0 - preference(v) for p, v in zip(pairs, verdicts)]


def test_vlrewardbench_layout_and_hand_checked_accuracy(tmp_path):
    pairs, report, layout = read_preference_benchmark(write_vlrb(tmp_path))
    assert layout == "vlrewardbench" and report.kept == 6
    assert [p.metadata["first_is_chosen"] for p in pairs[:5]] == [True, True, False, False, False]
    assert pairs[0].chosen == "first 0" and pairs[2].chosen == "second 2" and pairs[5].tie
    assert [p.metadata["category"] for p in pairs] == ["hallucination"] * 2 + ["general", "reasoning", "reasoning"] + [
        "general"
    ]
    assert Image.open(io.BytesIO(pairs[0].images[0]["bytes"])).getpixel((0, 0)) == COLORS["red"]
    # verdicts A, B, tie, A, B against gold first, first, second, second, second: right, wrong, tie (wrong in
    # VL-RewardBench), wrong, right -> 2/5; the gold tie is skipped
    m = benchmark_metrics(pairs, _prefs(pairs, ["A", "B", "tie", "A", "B", "A"]), TIE_CREDIT[layout])
    assert m["n"] == 5 and m["gold_ties_skipped"] == 1 and m["predicted_ties"] == 1
    assert m["accuracy"] == pytest.approx(0.4)
    assert m["accuracy/category/hallucination"] == 0.5 and m["accuracy/category/general"] == 0.0
    assert m["accuracy/category/reasoning"] == 0.5 and m["macro_accuracy"] == pytest.approx(1 / 3)
    assert m["accuracy/source/povid"] == 1.0 and m["accuracy/source/reasoning_tasks"] == 0.5
    lo, hi = m["accuracy_ci95"]
    assert 0.0 <= lo <= 0.4 <= hi <= 1.0


def test_multimodal_rewardbench_layout_and_ties_count_half(tmp_path):
    pairs, _, layout = read_preference_benchmark(write_mmrb(tmp_path))
    assert layout == "mmrewardbench" and len(pairs) == 5
    assert [p.metadata["category"] for p in pairs] == ["reasoning/math"] * 2 + ["safety/bias"] * 3
    assert pairs[3].chosen == "two 3" and pairs[0].chosen == "one 0"
    assert isinstance(pairs[4].images[0], bytes)  # base64 text decoded
    assert pairs[1].images[0] == str(tmp_path / "mmrb" / "images" / "1.png")
    # verdicts A, tie, B, tie, tie against Output1, Output1, Output1, Output2, Output2: 1 + 0.5 + 0 + 0.5 + 0.5
    m = benchmark_metrics(pairs, _prefs(pairs, ["A", "tie", "B", "tie", "tie"]), TIE_CREDIT[layout])
    assert m["accuracy"] == pytest.approx(2.5 / 5)
    assert m["accuracy/category/reasoning/math"] == pytest.approx(0.75)
    assert m["accuracy/category/safety/bias"] == pytest.approx(1 / 3)


def test_unknown_layout_names_the_fields(tmp_path):
    (tmp_path / "x.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(ValueError, match="unknown preference-benchmark layout"):
        read_preference_benchmark(tmp_path / "x.jsonl")


@pytest.mark.parametrize(
    "text, verdict",
    [
        ("<answer>A</answer>", ("A", True)),
        ("think... <answer> b </answer>", ("B", True)),
        ("<answer>Tie</answer>", ("tie", True)),
        ("<answer>A</answer> then <answer>B</answer>", ("B", True)),  # the last tag
        ("<answer>C</answer>", (None, True)),
        ("no tag at all", (None, False)),
        ("x" * 30_000 + "<answer>A</answer>", (None, False)),  # past the length cap: not read
    ],
)
def test_pairwise_verdicts(text, verdict):
    assert read_verdict(text, "pairwise") == verdict


def test_tolerant_reading_for_judge_rl():
    assert read_verdict("I think B is right", "pairwise", tolerant=True) == ("B", False)
    assert read_verdict("surely yes", "pointwise", tolerant=True) == ("yes", False)
    assert read_verdict("__import__('os')", "pairwise", tolerant=True) == (None, False)


def test_position_bias_hand_values():
    # four pairs; response 1 is better in the first two. Order AB (response 1 as A): A, A, A, B;
    # order BA (response 2 as A): B, A, A, A.
    ab = [1.0, 1.0, 1.0, 0.0]
    ba = [0.0, 1.0, 1.0, 1.0]
    m = position_bias(ab, ba, [True, True, False, False])
    assert m["consistency"] == 0.5  # pairs 0 (A then B) and 3 (B then A)
    assert m["accuracy_order_ab"] == 0.75  # right: 0, 1, 3
    assert m["accuracy_order_ba"] == 0.75  # right when response 2 is A: pair 0 says B, 2 and 3 say A
    assert swap_debiased(ab, ba) == [1.0, 0.5, 0.5, 0.0]
    assert m["accuracy_swap"] == 0.5  # pairs 0 and 3; 1 and 2 become ties
    assert m["first_position_rate"] == 6 / 8


def test_win_rates_against_the_group():
    # 3 samples: 0 beats 1, 0 ties 2, 2 beats 1
    assert win_rates(3, {(0, 1): 1.0, (0, 2): 0.5, (1, 2): 0.0}) == [0.75, 0.0, 0.75]
    assert win_rates(2, {}) == [0.5, 0.5]


def test_eval_reward_model_on_both_layouts_srm(tiny_model, tmp_path, capsys):
    base = tiny_model("qwen2_5_vl")
    srm_dir = tmp_path / "srm"
    srm = ScalarRewardModel.from_backbone(base, seed=3)
    srm.save_pretrained(srm_dir, processor=load_processor(base))
    # hand check: the SRM's own rewards give the accuracy the command reports
    pairs, _, _ = read_preference_benchmark(write_mmrb(tmp_path))
    items = [(p.prompt, p.images, p.chosen, None) for p in pairs] + [
        (p.prompt, p.images, p.rejected, None) for p in pairs
    ]
    with torch.no_grad():
        r = score_responses(srm.eval(), load_processor(base), items, 8).tolist()
    want = sum(1.0 if a > b else 0.0 if a < b else 0.5 for a, b in zip(r[:5], r[5:])) / 5
    out = tmp_path / "out"
    assert (
        main(
            ["eval-reward-model", str(srm_dir), str(tmp_path / "mmrb" / "all_data.json"), "--benchmark", "auto"]
            + ["--out-dir", str(out)]
        )
        == 0
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["kind"] == "srm" and metrics["benchmark"] == "mmrewardbench" and metrics["n"] == 5
    assert metrics["accuracy"] == pytest.approx(want)
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 5 and "reward " in html
    metrics = evaluate_benchmark(srm_dir, str(write_vlrb(tmp_path).parent), layout="vlrewardbench")
    assert metrics["n"] == 5 and "accuracy/category/reasoning" in metrics and not math.isnan(metrics["accuracy"])


def test_pairwise_judge_sees_both_orders(tiny_model, tmp_path):
    judge = tiny_model("qwen2_5_vl")  # an untrained judge: verdicts mostly unreadable, still counted
    metrics = evaluate_benchmark(
        judge, str(write_mmrb(tmp_path)), judge_mode="pairwise", debias="swap", max_new_tokens=6
    )
    assert metrics["kind"] == "grm-pairwise" and metrics["judgments"] == 10  # 5 pairs x 2 orders
    consistency = metrics["position_bias/consistency"]  # None when no verdict in either order names a response
    assert consistency is None or 0.0 <= consistency <= 1.0
    assert 0 <= metrics["unparsable"] <= 10 and metrics["n"] == 5


@pytest.mark.slow
def test_trained_pairwise_judge_emits_verdicts_and_its_position_bias(tiny_model, tmp_path):
    """A tiny pairwise judge trained by judge SFT (configs/reward_model/grm_pairwise_color.yaml) writes
    readable verdicts; its position-bias figures on 64 held-out colour pairs judged in both orders."""
    config = REPO / "configs" / "reward_model" / "grm_pairwise_color.yaml"
    run = tmp_path / "judge"
    args = [f"model.path={tiny_model('qwen2_5_vl')}", f"train.output_dir={run}", "logging.wandb=disabled"]
    assert main(["train-reward-model", str(config), *args, "logging.tensorboard=false"]) == 0
    pairs = write_records(make_preference_pairs("color", 64, seed=7, num_colors=2), tmp_path / "pairs.jsonl")
    m = evaluate_benchmark(run / "final", str(pairs), layout="records", judge_mode="pairwise", max_new_tokens=24)
    print({k: v for k, v in m.items() if k.startswith(("position_bias", "accuracy", "unparsable"))})
    assert m["judgments"] == 128 and m["unparsable"] <= 6  # the trained judge writes verdicts
    assert m["position_bias/accuracy_swap"] >= 0.8


def test_records_layout_resolves_image_paths_from_the_file(tmp_path):
    pairs = make_preference_pairs("color", 3, seed=7, num_colors=2)
    path = write_records(pairs, tmp_path / "pairs.jsonl")
    read, _, layout = read_preference_benchmark(path)
    assert layout == "records" and [p.chosen for p in read] == [p.chosen for p in pairs]
    assert all(Path(p.images[0]).is_file() for p in read)
    assert read[0].metadata["category"] == "color" and read[0].metadata["first_is_chosen"]
