"""The ``vlrft`` entry point and the set-up environment."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _vlrft(*args, **kw):
    return subprocess.run([sys.executable, "-m", "vlrft", *args], capture_output=True, text=True, **kw)


def test_help_of_every_subcommand(capsys):
    import vlrft
    from vlrft.cli import build_parser, main

    top = _vlrft("--help")  # the real entry point once; each subcommand's help in this process (seconds an import)
    assert top.returncode == 0 and "usage: vlrft" in top.stdout
    for name in ("train-policy", "train-sft", "train-dpo", "train-reward-model", "probe-rewards", "eval"):
        assert name in top.stdout
    with pytest.raises(SystemExit) as end:
        main(["--version"])
    assert end.value.code == 0 and capsys.readouterr().out.strip() == f"vlrft {vlrft.__version__}"
    sub = build_parser()._subparsers._group_actions[0].choices
    assert "make-tiny-model" in sub
    for name in sub:
        with pytest.raises(SystemExit) as end:
            main([name, "--help"])
        out = capsys.readouterr()
        assert end.value.code == 0 and f"usage: vlrft {name}" in out.out, out.err


def test_top_level_help_imports_neither_torch_nor_transformers():
    # the parser is built on every invocation: config schemas are imported when a command needs them
    code = (
        "import sys; from vlrft.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers', 'omegaconf') if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["['omegaconf']"]  # the config loader's, light (0.1 s)


def test_make_tiny_model_cli_writes_a_loadable_folder(tmp_path):
    res = _vlrft("make-tiny-model", str(tmp_path / "m"), "--arch", "qwen2", "--seed", "1")
    assert res.returncode == 0, res.stderr
    assert "wrote tiny qwen2" in res.stdout
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert model.config.num_hidden_layers == 2


def test_cli_defaults_match_the_factory():
    from vlrft.cli import build_parser
    from vlrft.models.tiny import TinySpec

    args = build_parser().parse_args(["make-tiny-model", "out"])
    for key, value in TinySpec().__dict__.items():
        assert getattr(args, key) == value, key


def test_no_cuda_packages_in_a_cpu_environment():
    import torch

    if torch.cuda.is_available():
        pytest.skip("GPU machine: the CUDA build of torch is expected here")
    listing = subprocess.run([sys.executable, "-m", "pip", "list"], capture_output=True, text=True).stdout
    assert "torch" in listing
    assert [line for line in listing.splitlines() if line.lower().startswith("nvidia-")] == []
