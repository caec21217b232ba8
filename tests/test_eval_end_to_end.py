"""``vlrft eval`` end to end with tiny models: outputs, the HTML report, resuming after a kill, in-training use."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from data_pipelines.records import PromptRecord
from eval.benchmarks import get_benchmark
from eval.runner import evaluate
from vlrft.archs import TEXT_ARCHS
from vlrft.cli import main as vlrft_main
from vlrft.errors import RunFolderError
from vlrft.models.loading import load_model

REPO = Path(__file__).resolve().parents[1]


class _Audit(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.urls, self.tags, self.classes = [], [], set(), []

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        a = dict(attrs)
        if tag == "img":
            self.images.append(a.get("src", ""))
        for key in ("href", "src", "action", "data"):
            if a.get(key):
                self.urls.append(a[key])
        if tag == "div":
            self.classes.append(a.get("class", ""))


def _audit(path: Path) -> _Audit:
    audit = _Audit()
    audit.feed(path.read_text(encoding="utf-8"))
    return audit


def test_geo3k_end_to_end_with_a_tiny_qwen2_5_vl_writes_all_outputs(tiny_model, shared_data, tmp_path):
    model, processor = load_model(tiny_model("qwen2_5_vl"))
    records = get_benchmark("geo3k").load(shared_data / "geo3k_examples", split="train")
    metrics = evaluate(model, processor, records, "geo3k", max_new_tokens=12, batch_size=4, out_dir=tmp_path)
    assert metrics["num_problems"] == 10 and 0.0 <= metrics["accuracy"] <= 1.0
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["accuracy"] == metrics["accuracy"] and saved["settings"]["benchmark"] == "geo3k"
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [r.id for r in records]
    assert rows[0]["images"][0].endswith("train/11/img_diagram.png") and "<think>" in rows[0]["prompt"]
    resp = rows[0]["responses"][0]
    assert (
        set(resp) >= {"text", "extracted", "correct", "score", "format_ok", "num_tokens"}
        and 0 < resp["num_tokens"] <= 12
    )
    audit = _audit(tmp_path / "report.html")
    assert len(audit.images) == 10 and all(src.startswith("data:image/png;base64,") for src in audit.images)
    assert not [u for u in audit.urls if not u.startswith("data:")], "the report must not reference anything outside"
    assert "link" not in audit.tags and "a" not in audit.tags
    assert sum("problem" in c for c in audit.classes) == 10 and all(
        ("right" in c) != ("wrong" in c) for c in audit.classes if "problem" in c
    )
    html = (tmp_path / "report.html").read_text()
    assert "show('right')" in html and "show('wrong')" in html and "http://" not in html and "https://" not in html


def test_killed_eval_resumes_to_the_same_metrics_as_an_uninterrupted_run(tiny_model, shared_data, tmp_path):
    model_dir = tiny_model("qwen2")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join((shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()[:64]) + "\n")
    killed = tmp_path / "killed"
    args = [
        "--benchmark",
        "gsm8k",
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--max-new-tokens",
        "48",
        "--batch-size",
        "1",
        "--no-progress",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlrft", "eval", *args, "--out", str(killed)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    samples = killed / "samples.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if samples.is_file() and samples.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    lines_at_kill = samples.read_bytes().count(b"\n")
    print(f"killed after {lines_at_kill} of 64 problems")
    assert 3 <= lines_at_kill < 64 and not (killed / "metrics.json").exists()

    model, tokenizer = load_model(model_dir)
    records = get_benchmark("gsm8k").load(data)
    common = dict(
        max_new_tokens=48,
        batch_size=1,
        run_info={"model": str(model_dir), "data": str(data), "split": "test", "limit": None},
    )
    resumed = evaluate(model, tokenizer, records, "gsm8k", out_dir=killed, **common)
    fresh_dir = tmp_path / "fresh"
    fresh = evaluate(model, tokenizer, records, "gsm8k", out_dir=fresh_dir, **common)
    assert resumed == fresh
    assert (killed / "metrics.json").read_text() == (fresh_dir / "metrics.json").read_text()
    rows_killed = sorted((killed / "samples.jsonl").read_text().splitlines())
    assert rows_killed == sorted((fresh_dir / "samples.jsonl").read_text().splitlines()) and len(rows_killed) == 64

    with pytest.raises(RunFolderError, match=r"other settings \(max_new_tokens: 48 -> 8\)"):  # a different run: refused
        evaluate(model, tokenizer, records, "gsm8k", out_dir=killed, **{**common, "max_new_tokens": 8})


def test_in_training_evaluate_is_seeded_and_leaves_the_trainer_state_alone(tiny_model, shared_data):
    model, tokenizer = load_model(tiny_model("qwen2"))
    model.train()
    records = get_benchmark("gsm8k").load(shared_data / "gsm8k" / "test.jsonl")[:3]
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    a = evaluate(model, tokenizer, records, "gsm8k", n=4, temperature=1.0, max_new_tokens=16, batch_size=2, seed=7)
    b = evaluate(model, tokenizer, records, "gsm8k", n=4, temperature=1.0, max_new_tokens=16, batch_size=2, seed=7)
    assert a == b and a["n"] == 4 and {"pass@4", "maj@4", "accuracy_ci95"} <= set(a)
    assert torch.equal(torch.get_rng_state(), rng) and model.training


def test_cli_user_benchmark_and_compare(tiny_model, tmp_path, capsys):
    data = tmp_path / "colors.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"c{i}", "prompt": f"What colour is thing {i}?", "answer": c}) + "\n"
            for i, c in enumerate(["red", "blue", "green"])
        )
    )
    model = str(tiny_model("qwen2"))
    for name, n, temp in (("greedy", "1", "0"), ("sampled", "3", "1.0")):
        rc = vlrft_main(
            [
                "eval",
                "--benchmark",
                "colors",
                "--verifier",
                "exact_match",
                "--model",
                model,
                "--data",
                str(data),
                "--out",
                str(tmp_path / name),
                "--n",
                n,
                "--temperature",
                temp,
                "--max-new-tokens",
                "8",
                "--no-progress",
            ]
        )
        assert rc == 0 and (tmp_path / name / "report.html").is_file()
    assert json.loads((tmp_path / "greedy" / "metrics.json").read_text())["verifier"] == "exact_match"
    capsys.readouterr()
    rc = vlrft_main(
        ["eval", "--compare", str(tmp_path / "greedy"), str(tmp_path / "sampled"), "--out", str(tmp_path / "cmp")]
    )
    printed = capsys.readouterr().out
    assert rc == 0 and "| run | benchmark |" in printed and "pass@3" in printed
    table = (tmp_path / "cmp" / "comparison.md").read_text().splitlines()
    assert len(table) == 4 and str(tmp_path / "sampled") in table[3]
    rows = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert rows[0]["pass@3"] is None and rows[1]["n"] == 3
    assert vlrft_main(["eval", "--benchmark", "gsm8k", "--model", model]) == 2  # missing --data/--out: config error


def test_load_model_reads_a_run_folders_final_model_and_refuses_missing_models(tiny_model, tmp_path):
    (tmp_path / "run").mkdir()
    os.symlink(tiny_model("qwen2"), tmp_path / "run" / "final")
    model, tok = load_model(tmp_path / "run")
    assert model.config.model_type == "qwen2" and hasattr(tok, "apply_chat_template")
    with pytest.raises(FileNotFoundError, match="hub ids need the network"):
        load_model("someone/not-here")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)


def test_prompt_records_with_relative_images(tiny_model, shared_data, tmp_path):
    import shutil

    shutil.copy(shared_data / "geo3k_examples" / "train" / "12" / "img_diagram.png", tmp_path / "d.png")
    (tmp_path / "recs.jsonl").write_text(
        json.dumps({"id": "x", "prompt": "<image>Find x.", "images": ["d.png"], "answer": "13"}) + "\n"
    )
    records = get_benchmark("mine", verifier="math_boxed").load(tmp_path / "recs.jsonl")
    assert records[0].images == [str(tmp_path / "d.png")]
    model, processor = load_model(tiny_model("qwen2_5_vl"))
    out = evaluate(model, processor, records, get_benchmark("mine", verifier="math_boxed"), max_new_tokens=4)
    assert out["num_problems"] == 1 and isinstance(records[0], PromptRecord)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen2_5_vl"])
def test_evaluate_through_the_trainers_rollout_engine(arch, tiny_model, shared_data, tmp_path):
    from vlrft.rollout import make_engine

    model, processor = load_model(tiny_model(arch))
    name, data, split = (
        ("gsm8k", shared_data / "gsm8k" / "test.jsonl", "test")
        if arch in TEXT_ARCHS
        else ("geo3k", shared_data / "geo3k_examples", "train")
    )
    records = get_benchmark(name).load(data, split=split)[:4]
    direct = evaluate(model, processor, records, name, max_new_tokens=12, batch_size=2, out_dir=tmp_path / "direct")
    engine = make_engine("hf", model, processor)
    via = evaluate(
        model, processor, records, name, max_new_tokens=12, batch_size=2, out_dir=tmp_path / "engine", engine=engine
    )
    texts = [
        [r["text"] for r in json.loads(line)["responses"]]
        for d in ("direct", "engine")
        for line in (tmp_path / d / "samples.jsonl").read_text().splitlines()
    ]
    assert texts[:4] == texts[4:] and direct == via
    sampled = evaluate(model, processor, records, name, n=3, temperature=1.0, max_new_tokens=8, engine=engine, seed=1)
    assert sampled["n"] == 3 and sampled == evaluate(
        model, processor, records, name, n=3, temperature=1.0, max_new_tokens=8, engine=engine, seed=1
    )
