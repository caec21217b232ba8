"""Shared fixtures: offline settings, tiny models built once per test session, the shared data folder."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _pin_cpu_arithmetic() -> dict[str, str]:
    """The same float32 arithmetic on every x86-64 machine with AVX2, AVX-512 ones included: PyTorch's own kernels
    (random draws, reductions, softmax, attention) at their AVX2 level, MKL's conditional numerical reproducibility
    at its AVX2 branch and oneDNN capped at AVX2. Learning proofs follow one trajectory of a tiny model, and where a
    run leaves a plateau depends on float rounding (docs/index.md, Same arithmetic on every machine): unpinned, an
    AVX-512 machine and an AVX2 one initialise and train differently, so a proof measured on one failed on the
    other. Set before torch loads; child processes (torchrun, the CLI) inherit it. A variable already set is kept."""
    try:
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    except OSError:
        return {}
    if " avx2" not in flags:
        return {}
    pins = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    for key, value in pins.items():
        os.environ.setdefault(key, value)
    return pins


PINNED = _pin_cpu_arithmetic()

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models are overhead-bound: one thread is as fast and does not fight parallel test processes.
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


def pytest_report_header(config):
    pins = ", ".join(f"{k}={os.environ[k]}" for k in PINNED) or "not pinned (no AVX2)"
    return f"cpu arithmetic: {pins}"


SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(arch, **sizes) -> Path``: a tiny random model folder, built once per session."""
    from vlrft.models.tiny import make_tiny_model

    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("tiny-models")

    def get(arch: str = "qwen2_5_vl", **sizes) -> Path:
        key = (arch, tuple(sorted(sizes.items())))
        if key not in cache:
            name = arch + "".join(f"-{k}{v}" for k, v in key[1])
            cache[key] = make_tiny_model(root / name, arch=arch, **sizes)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def srm_dir(tiny_model, tmp_path_factory) -> Path:
    """A scalar reward model folder (random head, seed 3) on the tiny Qwen2.5-VL, built once per session; tests
    read it, none writes into it."""
    from reward_models.scalar import ScalarRewardModel
    from vlrft.models.loading import load_processor

    base = tiny_model("qwen2_5_vl")
    out = tmp_path_factory.mktemp("srm") / "srm"
    ScalarRewardModel.from_backbone(base, seed=3).save_pretrained(out, processor=load_processor(base))
    return out


@pytest.fixture(scope="session")
def trained_judge(tiny_model, tmp_path_factory):
    """``trained_judge(**sizes) -> Path``: a judge on ``tiny_model("qwen2_5_vl", **sizes)``, SFT-trained (through
    train_reward_model) to answer yes for the candidate 'red' and no otherwise; built once per session and sizes."""
    from data_pipelines.formatting import pointwise_judgment_record
    from data_pipelines.synthetic import make_prompt_records
    from reward_models.config import RewardModelTrainConfig
    from vlrft.config import load_config
    from vlrft.trainer.reward_model_run import train_reward_model

    cache: dict[tuple, Path] = {}

    def get(**sizes) -> Path:
        key = tuple(sorted(sizes.items()))
        if key not in cache:
            out = tmp_path_factory.mktemp("judge") / "grm_run"
            prompts = make_prompt_records("color", 32, seed=7, num_colors=2)
            records = [
                pointwise_judgment_record(r, cand, correct=cand == "red") for r in prompts for cand in ("red", "green")
            ]
            overrides = [
                "model.kind=grm",
                f"model.path={tiny_model('qwen2_5_vl', **sizes)}",
                f"train.output_dir={out}",
                "train.max_steps=90",
                "train.batch_size=8",
                "optim.lr=3e-3",
                "train.eval_every=0",
                "train.log_every=20",
                "logging.wandb=disabled",
                "logging.tensorboard=false",
                "logging.progress_bar=false",
            ]
            summary = train_reward_model(load_config(RewardModelTrainConfig, None, overrides), (records, records[:16]))
            assert summary["eval_after"]["judgment_accuracy"] == 1.0
            cache[key] = out / "final"
        return cache[key]

    return get


@pytest.fixture(scope="session")
def always_a_judge(tiny_model, tmp_path_factory) -> Path:
    """A pairwise judge trained through train_reward_model's judge SFT path to answer A whatever it sees (pure
    position bias), built once per session."""
    from data_pipelines.formatting import pairwise_judgment_record
    from data_pipelines.synthetic import make_prompt_records
    from reward_models.config import RewardModelTrainConfig
    from vlrft.config import load_config
    from vlrft.trainer.reward_model_run import train_reward_model

    out = tmp_path_factory.mktemp("pairwise") / "judge"
    prompts = make_prompt_records("color", 16, seed=3, num_colors=2)
    records = [pairwise_judgment_record(r, a, b, "A") for r in prompts for a, b in (("red", "green"), ("green", "red"))]
    cfg = load_config(
        RewardModelTrainConfig,
        None,
        [
            "model.kind=grm",
            "judge.mode=pairwise",
            "judge.max_new_tokens=12",
            f"model.path={tiny_model('qwen2_5_vl')}",
            f"train.output_dir={out}",
            "train.max_steps=30",
            "train.batch_size=8",
            "optim.lr=3e-3",
            "train.eval_every=0",
            "logging.wandb=disabled",
            "logging.tensorboard=false",
            "logging.progress_bar=false",
        ],
    )
    assert train_reward_model(cfg, (records, records[:8]))["eval_after"]["judgment_accuracy"] == 1.0
    return out / "final"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (real GSM8K and Geometry3K examples); tests using it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder {SHARED_DATA} is absent")
    return SHARED_DATA


def pytest_collection_modifyitems(config, items):
    """Two test workers (scripts/test.sh runs pytest-xdist with ``--dist loadgroup``): the tests that start torchrun
    (marker ``distributed``: 2 gloo processes each) share one group, so they run one after another on one worker
    and the machine never holds more than three busy processes (two ranks and the other worker's test); and the
    tests with a time limit above the default (the longest learning proofs) come first, so that the two workers
    end together rather than one of them starting a 20-minute proof last (xdist hands out the largest group
    first, then the other tests in this order)."""
    default = float(config.getini("timeout") or 0)

    def limit(item) -> float:
        mark = item.get_closest_marker("timeout")
        return float(mark.args[0]) if mark and mark.args else default

    items.sort(key=lambda item: -limit(item) if limit(item) > default else 0.0)  # stable: otherwise file order
    for item in items:
        if item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.xdist_group("torchrun"))


def pytest_sessionfinish(session):
    """A worker hands its exactness margins to the controller, which prints them (pytest_terminal_summary)."""
    from tolerance import MEASURED

    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["tolerance"] = json.dumps(MEASURED)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent when pytest runs in one process
def pytest_testnodedown(node, error):
    from tolerance import MEASURED

    MEASURED.extend(json.loads(getattr(node, "workeroutput", {}).get("tolerance", "[]")))


def pytest_terminal_summary(terminalreporter):
    """The exactness checks' margins (tests/tolerance.py): the largest measured value / bound ratios."""
    from tolerance import MEASURED

    if not MEASURED:
        return
    worst = sorted(MEASURED, key=lambda r: -r["ratio"])[:8]
    terminalreporter.section("exactness margins (measured / bound, largest first)")
    for r in worst:
        terminalreporter.write_line(
            f"{r['ratio']:.3g}  {r['value']:.3g} / {r['bound']:.3g}  {r['what']}  [{r['test']}]"
        )


@pytest.fixture(scope="session")
def tool_policy(tmp_path_factory) -> Path:
    """A tiny Qwen2.5-VL (with Qwen's tool tokens) that calls the zoom tool: ``train-sft`` of 60 steps on the
    tool demonstrations of synthetic:mark_color (configs/sft/zoom_tools.yaml), enough for the call's format (which
    region it zooms into and the colour it names are still guesses). Built once per session (about 30 s)."""
    from tool_runs import tool_sft

    return tool_sft(tmp_path_factory.mktemp("tool-policy") / "sft")
