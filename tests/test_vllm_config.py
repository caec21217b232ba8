"""The vLLM engine's configuration and pure parts, in the default suite (no vLLM needed)."""

from __future__ import annotations

import importlib.util

import pytest

from vlrft.config import ConfigError, load_config
from vlrft.rollout.vllm_engine import VLLMConfig, VLLMRolloutEngine, collapse_image_pads
from vlrft.trainer.config import PolicyTrainConfig


def test_collapse_image_pads_leaves_one_placeholder_per_image():
    # two images of 3 and 2 tokens: vLLM expands each single placeholder again from the image itself
    assert collapse_image_pads([1, 9, 9, 9, 2, 9, 9, 3], 9) == [1, 9, 2, 9, 3]
    assert collapse_image_pads([1, 2], 9) == [1, 2]


def test_vllm_keys_resolve_and_bad_values_are_refused():
    cfg = load_config(
        PolicyTrainConfig,
        None,
        [
            "rollout.engine=vllm",
            "rollout.vllm.sleep_level=2",
            "rollout.vllm.max_model_len=1024",
            "algorithm.rollout_correction=sequence_mask",
            "algorithm.rollout_mask_threshold=3.0",
        ],
    )
    assert cfg.rollout.engine == "vllm" and cfg.rollout.vllm.sleep_level == 2
    assert cfg.rollout.vllm.max_model_len == 1024 and cfg.algorithm.rollout_correction == "sequence_mask"
    defaults = VLLMConfig()
    assert (defaults.gpu_memory_utilization, defaults.sleep_level, defaults.dtype) == (0.4, 1, "auto")
    for bad in ("rollout.engine=sglang", "rollout.vllm.sleep_level=3", "algorithm.rollout_correction=tis"):
        with pytest.raises(ConfigError):
            load_config(PolicyTrainConfig, None, [bad])
    with pytest.raises((ConfigError, ValueError), match="rollout_mask_threshold"):
        load_config(PolicyTrainConfig, None, ["algorithm.rollout_mask_threshold=1.0"]).validate()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_engine_without_vllm_says_how_to_get_it(tmp_path):
    with pytest.raises(ConfigError, match="scripts/setup.sh --vllm"):
        VLLMRolloutEngine(str(tmp_path), None)
