"""Eval outputs without a model: torn samples.jsonl lines, HTML escaping, the comparison table."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import pytest

from data_pipelines.records import PromptRecord
from eval.report import compare_runs, render_report
from eval.runner import read_samples, score_records


def test_read_samples_drops_and_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    good = [json.dumps({"id": f"p{i}", "responses": []}) + "\n" for i in range(3)]
    path.write_text("".join(good) + '{"id": "p3", "respo')
    done = read_samples(path)
    assert list(done) == ["p0", "p1", "p2"] and path.read_text() == "".join(good)
    assert read_samples(tmp_path / "absent.jsonl") == {}


def test_report_escapes_model_text_and_links_nothing():
    rec = PromptRecord(id="x<1>", prompt="Is <b>this</b> safe?", answer="3")
    hostile = "<script>fetch('https://evil.example')</script><img src=http://evil.example/a.png> \\boxed{3}"
    metrics, rows = score_records([rec], [[hostile, "#### 4"]], "gsm8k")
    page = render_report(metrics, rows, [rec], title="t")

    class Audit(HTMLParser):
        urls, scripts = [], 0

        def handle_starttag(self, tag, attrs):
            Audit.scripts += tag == "script"
            Audit.urls += [v for k, v in attrs if k in ("src", "href") and v]

    Audit().feed(page)
    assert Audit.urls == [] and Audit.scripts == 1  # only the report's own inline filter script
    assert "&lt;script&gt;" in page and "x&lt;1&gt;" in page and "1/2 correct" in page
    assert "✓ right" in page and "✗ wrong" in page


def test_compare_runs_table(tmp_path):
    for name, acc in (("a", 0.25), ("b", 0.5)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(
            json.dumps(
                {
                    "benchmark": "gsm8k",
                    "num_problems": 4,
                    "n": 2,
                    "accuracy": acc,
                    "accuracy_ci95": [0.0, 1.0],
                    "pass@1": acc,
                    "pass@2": 0.5,
                    "maj@1": acc,
                    "maj@2": acc,
                    "format_rate": 1.0,
                }
            )
        )
    table, rows = compare_runs([tmp_path / "a", tmp_path / "b"])
    lines = table.splitlines()
    assert lines[0].startswith("| run | benchmark | num_problems | n | accuracy |") and "pass@2" in lines[0]
    assert "| 0.2500 |" in lines[2] and "| 0.5000 |" in lines[3] and rows[1]["accuracy"] == 0.5
    with pytest.raises(FileNotFoundError, match="no metrics.json"):
        compare_runs([tmp_path])
