"""Reports: a self-contained HTML page per run, and a comparison table across runs.

The HTML report has no external resource: images are embedded as ``data:image/png;base64`` URIs, styles
and the right/wrong filter are inline, and there are no links. Every text is HTML-escaped.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any, Sequence

from data_pipelines.images import load_image, png_data_uri
from data_pipelines.video import preview_frames

THUMBNAIL_PX = 384
_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:70em}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}
.problem{border:1px solid #ccc;border-radius:6px;margin:1em 0;padding:.6em}
.right{border-left:6px solid #2a2}.wrong{border-left:6px solid #c22}
pre{white-space:pre-wrap;background:#f6f6f6;padding:.4em;margin:.3em 0}
.ok{color:#2a2;font-weight:bold}.bad{color:#c22;font-weight:bold}img{max-width:384px;display:block}
.strip{display:flex;gap:2px}.strip img{display:inline}
"""
_SCRIPT = """
function show(which){for(const el of document.querySelectorAll('.problem')){
el.style.display=(which==='all'||el.classList.contains(which))?'':'none';}}
"""


def image_data_uri(image: Any) -> str | None:
    """A PNG data URI of a record image (path, bytes, data URI, dict or PIL), shrunk to a thumbnail."""

    try:
        im = load_image(image, max_pixels=None)
    except Exception:  # noqa: BLE001 - a report shows what it can; the run already used the image
        return None
    im.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
    return png_data_uri(im)


def video_strip(video: Any) -> str:
    """A strip of thumbnails of up to 8 frames spread over a record's video (path or frame list)."""
    try:
        frames = preview_frames(video)
    except Exception:  # noqa: BLE001 - a report shows what it can; the run already used the video
        return "<p>(video could not be read)</p>"
    cells = []
    for im in frames:
        im.thumbnail((THUMBNAIL_PX // 2, THUMBNAIL_PX // 2))
        cells.append(f"<img src='{png_data_uri(im)}' alt='video frame'>")
    return "<div class='strip'>" + "".join(cells) + "</div>"


def _metrics_table(metrics: dict[str, Any]) -> str:
    rows = []
    for key, value in metrics.items():
        if isinstance(value, float):
            value = f"{value:.4f}"
        elif isinstance(value, list):
            value = ", ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in value)
        rows.append(f"<tr><th>{html.escape(str(key))}</th><td>{html.escape(str(value))}</td></tr>")
    return "<table>" + "".join(rows) + "</table>"


def _turns(resp: dict[str, Any], images: list[Any]) -> str:
    """A trajectory's turns: each assistant turn's text, then each tool observation with the images it returned."""
    esc, parts, shown = html.escape, [], iter(images)
    for k, turn in enumerate(resp["turns"]):
        parts.append(f"<p><i>turn {k + 1}</i></p><pre>{esc(turn['text'])}</pre>")
        for obs in turn.get("observations", []):
            parts.append(f"<p><i>tool</i></p><pre>{esc(obs['text'])}</pre>" if obs["text"] else "<p><i>tool</i></p>")
            for _ in range(obs["images"]):
                im = next(shown, None)
                uri = image_data_uri(im) if im is not None else None
                parts.append(f"<img src='{uri}' alt='returned image'>" if uri else "<p>(image not kept)</p>")
    return "".join(parts)


def render_report(
    metrics: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    records: Sequence[Any] = (),
    title: str = "evaluation",
    turn_images: dict[tuple[str, int], list[Any]] | None = None,
) -> str:
    """The HTML page: metrics, then per problem its images, prompt, reference and every response with
    its extracted answer marked right or wrong (a trajectory: each turn, with the images tools returned,
    ``turn_images[(id, response index)]``). A problem counts as right when any response is correct.
    A row may name its own ``heading`` (instead of "k/n correct") and a response its own ``mark``."""
    images = {r.id: list(r.images) for r in records}
    videos = {r.id: list(getattr(r, "videos", ())) for r in records}
    esc = html.escape
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(title)}</title>",
        f"<style>{_STYLE}</style><script>{_SCRIPT}</script></head><body>",
        f"<h1>{esc(title)}</h1>",
        _metrics_table(metrics),
        "<p>Show: <button onclick=\"show('all')\">all</button> <button onclick=\"show('right')\">right</button> "
        "<button onclick=\"show('wrong')\">wrong</button></p>",
    ]
    for row in rows:
        right = row["num_correct"] > 0
        parts.append(f"<div class='problem {'right' if right else 'wrong'}'>")
        heading = row.get("heading") or f"{row['num_correct']}/{len(row['responses'])} correct"
        parts.append(f"<h3>{esc(str(row['id']))} — {esc(heading)}</h3>")
        for img in images.get(row["id"], []):
            uri = image_data_uri(img)
            parts.append(f"<img src='{uri}' alt='problem image'>" if uri else "<p>(image could not be read)</p>")
        parts += [video_strip(video) for video in videos.get(row["id"], [])]
        parts.append(f"<b>Prompt</b><pre>{esc(row['prompt'])}</pre><b>Reference:</b> {esc(str(row['answer']))}")
        for i, resp in enumerate(row["responses"]):
            label = resp.get("mark") or ("✓ right" if resp["correct"] else "✗ wrong")
            mark = f"<span class='{'ok' if resp['correct'] else 'bad'}'>{esc(label)}</span>"
            extracted = esc(str(resp["extracted"])) if resp["extracted"] is not None else "<i>none</i>"
            err = f" ({esc(resp['error'])})" if resp.get("error") else ""
            head = f"<p><b>Response {i + 1}</b> — extracted: {extracted} {mark}{err}</p>"
            if resp.get("turns"):
                parts.append(head + _turns(resp, (turn_images or {}).get((row["id"], i), [])))
            else:
                parts.append(head + f"<pre>{esc(resp['text'])}</pre>")
        parts.append("</div>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(
    path: str | Path,
    metrics: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    records: Sequence[Any] = (),
    title: str = "evaluation",
    turn_images: dict[tuple[str, int], list[Any]] | None = None,
) -> Path:
    path = Path(path)
    path.write_text(render_report(metrics, rows, records, title, turn_images), encoding="utf-8")
    return path


COMPARE_KEYS = (
    "num_problems",
    "n",
    "accuracy",
    "accuracy_ci95",
    "pass@1",
    "maj@1",
    "format_rate",
    "mean_response_tokens",
    "mean_response_chars",
)


def compare_runs(run_dirs: Sequence[str | Path]) -> tuple[str, list[dict[str, Any]]]:
    """A Markdown table of the runs' metrics (one row per run; pass@k/maj@k for every k any run has)."""
    runs = []
    for d in run_dirs:
        f = Path(d) / "metrics.json"
        if not f.is_file():
            raise FileNotFoundError(f"--compare {d}: no metrics.json there (not a finished vlrft eval run?)")
        runs.append({"run": str(d), **json.loads(f.read_text())})
    ks = sorted(
        {key for r in runs for key in r if key.startswith(("pass@", "maj@"))},
        key=lambda s: (s.split("@")[0], int(s.split("@")[1])),
    )
    keys = ["run", "benchmark"] + [k for k in COMPARE_KEYS if k not in ("pass@1", "maj@1")] + ks

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4f}"
        if isinstance(v, list):
            return "[" + ", ".join(cell(x) for x in v) + "]"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in runs]
    table = [{k: r.get(k) for k in keys} for r in runs]
    return "\n".join(lines) + "\n", table
