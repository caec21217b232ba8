"""``scripts/gpu_check.py``, the GPU figures' driver, in its CPU smoke (``--shape tiny``, torchrun with one gloo
process): what it writes and what it counts. Two faults first seen on an H200 (issue 27's sweep): the run's final
checkpoint was still written (3B with fp32 AdamW state is about 45 GB; it filled the machine's disk and ended the
next configuration), and the decode figure counted the prefill's rows (one per prompt) as the decode's (one per
sample), so its tokens/s and KV-cache roofline were 8x too low at 8 samples per prompt."""

from __future__ import annotations

import json

from launch import REPO, run_job, subprocess_env, torchrun


def test_gpu_check_smoke_writes_its_json_and_no_checkpoint(tmp_path):
    out, js = tmp_path / "run", tmp_path / "json"
    args = ["--shape", "tiny", "--model-dir", str(tmp_path / "model"), "--steps", "2", "--prompts", "2"]
    args += ["--samples", "4", "--max-new-tokens", "6", "--image-tokens", "16", "--inference-copy", "on"]
    args += ["--micro-batch-tokens", "4096", "--json-dir", str(js), "--name", "smoke", "--out-dir", str(out)]
    args += ["--profile-step", "2", "--census-step", "2", "--census-where", "mm"]
    cmd = torchrun(str(REPO / "scripts" / "gpu_check.py"), *args, nproc=1)
    done = run_job(cmd, env=subprocess_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((js / "smoke.json").read_text())
    assert result["complete"] and [s["step"] for s in result["steps"]] == [1, 2]
    for step in result["steps"]:
        decode = step["decode"]
        assert decode["rows"] == 2 * 4  # prompts x samples: the rows every decode step runs, not the prefill's 2
        assert step["samples"] == 8 and step["update_response_tokens"] > 0
        # tokens/s is rows per decode step over the step's time (the step's ms are rounded to 0.01: within 1 %)
        assert abs(decode["measured_tokens_per_s"] * decode["measured_ms_per_step"] / 1e3 - 8) < 0.08
        assert set(step["engine_s"]) == {"sleep", "wake"} and min(step["engine_s"].values()) >= 0
        # token budget 4096: one micro-batch holds both groups, each prompt computed once
        assert step["update_micro_batches"] == 1
    # --profile-step 2: that step alone says what bounds its rollout and its update (on CPU: operators, no kernels)
    assert result["config"]["profile_step"] == 2 and result["steps"][0]["profile"] == {}
    assert isinstance(result["compile_counters"], dict)  # torch.compile's record: nothing compiles on CPU
    assert [s["cudagraphs_recorded"] for s in result["steps"]] == [0, 0]  # nor records CUDA graphs
    assert result["cudagraph_skip_reasons"] == {}  # nor logs a skip (torch logs those of CUDA graphs only)
    profile = result["steps"][1]["profile"]
    assert set(profile) == {"rollout", "update"}
    for (phase,) in profile.values():
        assert phase["kernel_launches"] == 0 and phase["device_busy_fraction"] is None and phase["top_kernels"] == []
        assert 0 < phase["cpu_self_s"] and {"aten::mm", "aten::addmm"} & {op["name"] for op in phase["top_cpu_ops"]}
    # --census-step 2: that step's operators (a GPU's kernel launches), the update's products among them
    assert result["steps"][0]["census"] == {} and set(result["steps"][1]["census"]) == {"rollout", "update"}
    (update,) = result["steps"][1]["census"]["update"]
    assert update["ops"] >= sum(update["top_ops"].values()) > 0 and update["top_ops"]["mm"] > 0
    assert sum(update["sites"].values()) == update["top_ops"]["mm"]  # each product's call site, by --census-where
    assert not (out / "checkpoints").exists()  # neither a step's checkpoint nor the run's last
    assert (out / "metrics.jsonl").is_file()


def test_update_work_counts_each_prompt_once_per_micro_batch():
    """Hand-counted: 2 prompts (lengths 10 and 20, one image of 4 patches each) x 2 samples (responses 3, 5 and 2, 4
    tokens). One micro-batch of all four computes each prompt once; micro-batches of one sample compute a prompt
    for every sample, as without the group-shared forward."""
    import sys
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_figures import experience_work

    batch = {
        "prompt_lengths": torch.tensor([10, 10, 20, 20]),
        "response_lengths": torch.tensor([3, 5, 2, 4]),
        "prompt_index": torch.tensor([0, 0, 1, 1]),
        "image_grid_thw": torch.tensor([[1, 2, 2]] * 4),
        "images_per_sample": torch.tensor([1, 1, 1, 1]),
    }
    exp = SimpleNamespace(batch=batch)
    whole, _ = experience_work(exp, shared=True)
    assert whole["seq_tokens"] == 10 + 20 + 3 + 5 + 2 + 4 and whole["image_patches"] == 8
    # prompt pairs P^2/2 once per prompt, response pairs R*P + R(R+1)/2 per sample
    assert whole["attention_pairs"] == 50 + 200 + (30 + 6) + (50 + 15) + (40 + 3) + (80 + 10)
    ones, _ = experience_work(exp, shared=True, micro_batches=[[0], [1], [2], [3]])
    plain, _ = experience_work(exp, shared=False)
    assert ones["seq_tokens"] == 10 + 10 + 20 + 20 + 14 == plain["seq_tokens"] and ones["image_patches"] == 16
    pairs = sum(P * P / 2 + R * P + R * (R + 1) / 2 for P, R in [(10, 3), (10, 5), (20, 2), (20, 4)])
    assert ones["attention_pairs"] == pairs and ones["logit_rows"] == whole["logit_rows"] == 14
    twice, _ = experience_work(exp, shared=True, micro_batches=[[0, 1, 2, 3], [0, 1, 2, 3]])  # two epochs
    assert twice["seq_tokens"] == 2 * whole["seq_tokens"] and twice["logit_rows"] == 28


def test_profile_summary_ranks_the_operators_a_phase_ran():
    """``gpu_figures.profile_summary`` on a real profile: 5 products of 256^3 and 40 small additions; the products
    lead the CPU operators, with their call counts, and their time is within the phase's wall time."""
    import sys
    import time

    import torch

    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_figures import profile_summary, profiler_activities

    a, b, c = torch.randn(256, 256), torch.randn(256, 256), torch.randn(8)
    with torch.profiler.profile(activities=profiler_activities()) as prof:
        t0 = time.perf_counter()
        for _ in range(5):
            torch.mm(a, b)
        for _ in range(40):
            torch.add(c, c)
        wall = time.perf_counter() - t0
    summary = profile_summary(prof.key_averages(), wall, top=4)
    ops = summary["top_cpu_ops"]
    assert ops[0]["name"] == "aten::mm" and ops[0]["calls"] == 5 and len(ops) <= 4
    assert {"name": "aten::add", "calls": 40} in [{k: op[k] for k in ("name", "calls")} for op in ops]
    assert 0 < ops[0]["s"] <= summary["wall_s"] and summary["wall_s"] == round(wall, 4)
    if not torch.cuda.is_available():
        assert summary["kernel_launches"] == 0 and summary["device_busy_fraction"] is None


def test_op_census_counts_the_kernels_of_forward_and_backward_not_the_views():
    """``gpu_figures.OpCensus`` over one linear layer's forward and backward: the product (``addmm``), the weight's
    gradient (``mm``), the bias's (``sum``), the loss's ``sum`` and the ones its backward starts from, each once;
    the views between them (the weight's transpose, the gradient's expansion, detaches) launch nothing and are not
    counted. The call sites it is asked for name this file's line, not torch's."""
    import sys

    import torch

    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_figures import OpCensus

    layer, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    with OpCensus(where=("addmm", "mm")) as census:
        layer(x).sum().backward()
    summary = census.summary()
    assert summary["top_ops"] == {"addmm": 1, "mm": 1, "sum": 2, "ones_like": 1} and summary["ops"] == 5
    assert {site.split(" at ")[1].split(":")[0] for site in summary["sites"]} == {"test_gpu_check.py"}
    assert sorted(summary["sites"].values()) == [1, 1]


def test_cudagraph_skips_collects_torch_s_skip_messages_by_their_first_line():
    """The reasons behind inductor's ``cudagraph_skips`` counter, as torch itself logs them (its own logging function,
    the message formats of its CPU-node check and of its re-record limit), counted by first line; other inductor
    warnings are not reasons."""
    import logging
    import sys

    from torch._inductor.cudagraph_utils import format_default_skip_message, log_cudagraph_skip_and_bump_counter

    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_figures import CudagraphSkips

    skips = CudagraphSkips.attach()
    try:
        cpu = format_default_skip_message("cpu device (arange_1). Found from : \n  File model.py, line 3")
        limit = (  # the re-record limit's message (cudagraph_trees.py): "cudagraph", not "cudagraphs"
            "skipping cudagraph due to function 0 exceeding max re-recording limit (=128) on cudagraph node None due "
            "to static input data pointer changed."
        )
        for message in (cpu, cpu, format_default_skip_message("mutated inputs (2 instances)"), limit):
            log_cudagraph_skip_and_bump_counter(message)
        logging.getLogger("torch._inductor.compile_fx").warning("not a skip")
    finally:
        logging.getLogger("torch._inductor").removeHandler(skips)
    assert skips.reasons == {
        "skipping cudagraphs due to cpu device (arange_1). Found from : ": 2,
        "skipping cudagraphs due to mutated inputs (2 instances)": 1,
        limit: 1,
    }
