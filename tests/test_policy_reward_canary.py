"""The reward canary of train-policy (``train.probe_every``): it logs the probes' metrics and names a flagged probe
once, and training with it is bitwise the training without it, resumed runs included."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from vlrft.config import load_config
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.run import train_policy

# the lenient reading the canary must flag (docs/reward-models.md, "Probing rewards for hacks")
LENIENT = "reward.sources=[{name: accuracy, kind: verifier, verifier: vocab_answer, verifier_options: {lenient: true}}]"


def _run(model: Path, out: Path, *extra: str) -> dict:
    overrides = [
        f"model.path={model}",
        f"train.output_dir={out}",
        LENIENT,
        "data.eval_source=''",
        "data.synthetic_train_size=8",
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4",
        "train.micro_train_batch_size=8",
        "optim.lr=1e-3",
        "algorithm.entropy_coef=0.01",  # a gradient from every sample: the weights tell which samples were drawn
        "logging.tensorboard=false",
        "logging.wandb=disabled",
        "logging.progress_bar=false",
        *extra,
    ]
    return train_policy(load_config(PolicyTrainConfig, None, overrides))


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_canary_logs_probes_and_leaves_training_bitwise_unchanged(tiny_model, tmp_path, capsys):
    model = tiny_model("qwen2_5_vl")
    _run(model, tmp_path / "plain", "train.max_steps=3")
    plain_out = capsys.readouterr()
    _run(model, tmp_path / "canary", "train.max_steps=3", "train.probe_every=1", "train.probe_records=3")
    printed = capsys.readouterr()
    assert "reward probes" not in plain_out.out + plain_out.err

    rows = [r for r in _metrics(tmp_path / "canary") if "probe/flagged" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # lenient vocab_answer pays the answer among junk: every record, every time
        assert r["probe/repeated"] == r["probe/padded"] == r["probe/long"] == 1.0
        assert r["probe/empty"] == r["probe/whitespace"] == r["probe/wrong"] == 0.0
        assert r["probe/flagged"] >= 3
    print("canary metrics per step:", [{k: v for k, v in r.items() if k.startswith("probe/")} for r in rows])
    assert not any("probe/" in k for r in _metrics(tmp_path / "plain") for k in r)
    said = [line for line in (printed.out + printed.err).splitlines() if "reward probes flagged" in line]
    assert len(said) == 1 and said[0].startswith("step 1:") and "padded" in said[0], said  # once, at its first time

    a, b = _weights(tmp_path / "plain"), _weights(tmp_path / "canary")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resumed_run_with_the_canary_is_bitwise_the_uninterrupted_one(tiny_model, tmp_path, capsys):
    model = tiny_model("qwen2_5_vl")
    canary = ("train.probe_every=1", "train.probe_records=3", "train.save_every=1")
    _run(model, tmp_path / "whole", "train.max_steps=3", *canary)
    _run(model, tmp_path / "resumed", "train.max_steps=2", *canary)  # then continued to 3 (max_steps may change)
    capsys.readouterr()
    _run(model, tmp_path / "resumed", "train.max_steps=3", *canary)
    printed = capsys.readouterr()
    assert "resumed from" in printed.out + printed.err
    assert "reward probes flagged" not in printed.out + printed.err  # said before the checkpoint: not again

    a, b = _weights(tmp_path / "whole"), _weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    last = [r for r in _metrics(tmp_path / "whole") if r["step"] == 3 and "probe/flagged" in r]
    again = [r for r in _metrics(tmp_path / "resumed") if r["step"] == 3 and "probe/flagged" in r]
    keys = [k for k in last[0] if k.startswith("probe/")]
    assert [last[0][k] for k in keys] == [again[0][k] for k in keys]
