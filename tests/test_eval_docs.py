"""The example at the top of docs/eval.md runs as written."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_docs_eval_example_runs(shared_data, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the example reads ../shared/data from the project root
    text = (REPO / "docs" / "eval.md").read_text()
    script = tmp_path / "eval_example.py"
    script.write_text(re.search(r"```python\n(.*?)```", text, re.S).group(1))
    ns = runpy.run_path(str(script))
    assert ns["metrics"]["num_problems"] == 8 and (Path(ns["out"]) / "run" / "report.html").is_file()
