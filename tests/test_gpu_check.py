"""``scripts/gpu_check.py``, the GPU figures' driver, in its CPU smoke (``--shape tiny``, torchrun with one gloo
process): what it writes and what it counts. Two faults first seen on an H200 (issue 27's sweep): the run's final
checkpoint was still written (3B with fp32 AdamW state is about 45 GB; it filled the machine's disk and ended the
next configuration), and the decode figure counted the prefill's rows (one per prompt) as the decode's (one per
sample), so its tokens/s and KV-cache roofline were 8x too low at 8 samples per prompt."""

from __future__ import annotations

import json
import subprocess

from launch import REPO, subprocess_env, torchrun


def test_gpu_check_smoke_writes_its_json_and_no_checkpoint(tmp_path):
    out, js = tmp_path / "run", tmp_path / "json"
    args = ["--shape", "tiny", "--model-dir", str(tmp_path / "model"), "--steps", "2", "--prompts", "2"]
    args += ["--samples", "4", "--max-new-tokens", "6", "--image-tokens", "16", "--inference-copy", "on"]
    args += ["--micro-batch-tokens", "4096", "--json-dir", str(js), "--name", "smoke", "--out-dir", str(out)]
    cmd = torchrun(str(REPO / "scripts" / "gpu_check.py"), *args, nproc=1)
    done = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((js / "smoke.json").read_text())
    assert result["complete"] and [s["step"] for s in result["steps"]] == [1, 2]
    for step in result["steps"]:
        decode = step["decode"]
        assert decode["rows"] == 2 * 4  # prompts x samples: the rows every decode step runs, not the prefill's 2
        assert step["samples"] == 8 and step["update_response_tokens"] > 0
        # tokens/s is rows per decode step over the step's time (the step's ms are rounded to 0.01: within 1 %)
        assert abs(decode["measured_tokens_per_s"] * decode["measured_ms_per_step"] / 1e3 - 8) < 0.08
    assert not (out / "checkpoints").exists()  # neither a step's checkpoint nor the run's last
    assert (out / "metrics.jsonl").is_file()
