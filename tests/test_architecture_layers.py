"""The layering of docs/architecture.md, read from the source tree's import graph (ast, nothing imported).

Layers, lowest first: ``data_pipelines`` < vlrft's lower layer (configs, models, strategies, rollout,
algorithms, tracking, checkpoints) < ``reward_models`` < ``eval`` < vlrft's upper layer (``vlrft.trainer``,
``vlrft.commands``, ``vlrft.cli``). A module imports only its own layer and the ones below;
``vlrft.algorithms`` imports only torch and the standard library. Inside the lower layer, models, strategies
and rollout engines keep apart, and the modules of each rank by job (``MODULE_RANKS``). Imports sit at module
top: a deferred import (inside a function) is allowed only for an optional heavy dependency, or in the CLI, whose
subcommands load lazily so that ``vlrft --help`` stays fast.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data_pipelines", "vlrft", "reward_models", "eval")
UPPER = ("vlrft.trainer", "vlrft.commands", "vlrft.cli", "vlrft.__main__")
RANK = {"data_pipelines": 0, "vlrft-lower": 1, "reward_models": 2, "eval": 3, "vlrft-upper": 4}
# optional or heavy third-party modules a function may import when it needs them (each named with why)
DEFERRABLE = {
    "deepspeed": "optional strategy; its import initialises accelerators",
    "vllm": "optional rollout engine",
    "peft": "only with LoRA",
    "matplotlib": "only to draw the run's curves",
    "wandb": "optional tracker",
    "torch.utils.tensorboard": "optional tracker; imports tensorboard",
    "datasets": "only for hub ids and save_to_disk folders; slow to import",
    "torch.utils.cpp_extension": "only where DeepSpeed starts (its op build folder); imports setuptools, 0.15 s",
    "pyarrow": "only for Parquet files",
    "math_verify": "imported in the math worker's child process only",
    "resource": "the math worker's child process limits itself (POSIX only)",
    "qwen_vl_utils": "imports torchvision, which CPU machines lack",
    "transformers.models.qwen2_vl.image_processing_qwen2_vl": "needs torchvision (fallback only)",
    "torchvision": "probed: CPU machines have a CUDA-only build that fails at import",
}

# Inside vlrft's lower layer: packages that must not know each other (a model piece knows no strategy or engine;
# engines get the weights streamed to them, so they know no strategy) ...
APART = {
    "vlrft.models": ("vlrft.strategies", "vlrft.rollout", "vlrft.loop", "vlrft.supervised"),
    "vlrft.strategies": ("vlrft.rollout", "vlrft.loop", "vlrft.supervised"),
    "vlrft.rollout": ("vlrft.strategies", "vlrft.loop", "vlrft.supervised"),
}
# ... and, inside the packages split by job, ranks: a module imports only modules of a lower rank of its package
# (a new module gets a rank here). The group-shared forward: the attention pieces, their one registration with
# transformers, then packing and loading; a strategy's parts, its base, then the registered implementations;
# the rollout's protocol and registry, the hf engine's parts, the hf builder, then the rollout config.
MODULE_RANKS = {
    "vlrft.models": {
        **dict.fromkeys(("cpu_matmul", "processing", "vision_attention", "prefix_decoding", "patch_embedding"), 0),
        "packed_attention": 1,
        "attention_functions": 2,
        **dict.fromkeys(("packing", "loading", "tiny", "moe"), 3),
        "routing_replay": 4,
    },
    "vlrft.strategies": {
        **dict.fromkeys(("registry", "process", "rng", "numerics", "blocks", "export", "weight_stream"), 0),
        "config": 1,
        "placement": 1,
        **dict.fromkeys(("optim", "adapt"), 2),
        "base": 3,
        **dict.fromkeys(("single", "fsdp2", "deepspeed"), 4),
    },
    "vlrft.rollout": {
        **dict.fromkeys(("base", "registry", "static_cache", "keyed", "async_config"), 0),
        **dict.fromkeys(("trajectories", "hf_engine"), 1),
        **dict.fromkeys(("generation", "inference_copy", "vllm_engine"), 2),
        "hf": 3,
        "config": 4,
    },
}
# modules that only the named packages may import: the CPU matrix-product path is the strategy's to apply
ONLY_FOR = {"vlrft.models.cpu_matmul": ("vlrft.strategies", "vlrft.models.cpu_matmul")}


def inner_violations(me: str, target: str) -> list[str]:
    """The lower layer's inner rules (APART, MODULE_RANKS, ONLY_FOR) broken by ``me`` importing ``target``."""
    found = []
    for pkg, banned in APART.items():
        if me.startswith(pkg + ".") or me == pkg:
            found += [f"({pkg} must not import {b})" for b in banned if target == b or target.startswith(b + ".")]
    for pkg, ranks in MODULE_RANKS.items():
        mine, theirs = me.removeprefix(pkg + "."), target.removeprefix(pkg + ".")
        if not (me.startswith(pkg + ".") and target.startswith(pkg + ".")) or mine == theirs:
            continue
        if mine not in ranks or theirs not in ranks:
            new = mine if mine not in ranks else theirs
            found.append(f"({pkg}.{new} has no rank: add it to MODULE_RANKS)")
        elif ranks[theirs] >= ranks[mine]:
            found.append(f"({pkg}: rank {ranks[mine]} module {mine} must not import rank {ranks[theirs]} {theirs})")
    for module, allowed in ONLY_FOR.items():
        if target == module and not me.startswith(allowed):
            found.append(f"(only {', '.join(allowed)} may import {module})")
    return found


def layer(module: str) -> str | None:
    top = module.split(".")[0]
    if top != "vlrft":
        return top if top in PACKAGES else None
    return "vlrft-upper" if module.startswith(UPPER) else "vlrft-lower"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, deferred) for every import of a source file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, deferred) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                out.append((child.module, child.lineno, deferred))
            elif isinstance(child, ast.ImportFrom) and child.level:
                raise AssertionError(f"{path}:{child.lineno}: relative import; use absolute imports")
            visit(child, deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return out


def source_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def violations(files: list[Path] | None = None) -> list[str]:
    found = []
    for path in files or source_files():
        me = module_name(path)
        mine = layer(me)
        for target, line, deferred in imports(path):
            where = f"{path.relative_to(ROOT)}:{line}: {me} imports {target}"
            theirs = layer(target)
            if me.startswith("vlrft.algorithms"):
                top = target.split(".")[0]
                if not (top == "torch" or top in sys.stdlib_module_names or target.startswith("vlrft.algorithms")):
                    found.append(f"{where} (vlrft.algorithms imports only torch and the standard library)")
            if theirs is not None and RANK[theirs] > RANK[mine]:
                found.append(f"{where} (layer {mine} must not import the higher layer {theirs})")
            if mine == "vlrft-lower" and theirs == "vlrft-lower":
                found += [f"{where} {why}" for why in inner_violations(me, target)]
            if deferred and not me.startswith(("vlrft.cli", "vlrft.commands")):
                if not any(target == m or target.startswith(m + ".") for m in DEFERRABLE):
                    found.append(f"{where} inside a function (imports go at module top; see DEFERRABLE)")
    return found


def test_the_source_tree_keeps_its_layers_and_imports_at_top():
    found = violations()
    assert not found, "forbidden imports:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "where, code",
    [
        ("data_pipelines/bad.py", "from vlrft.config import option\n"),
        ("vlrft/strategies/bad.py", "import reward_models.pool\n"),
        ("reward_models/bad.py", "from vlrft.trainer.run import train_policy\n"),
        ("vlrft/algorithms/bad.py", "import numpy\n"),
        ("reward_models/bad.py", "from eval.runner import evaluate\n"),
        ("eval/bad.py", "def f():\n    import json\n"),
        ("vlrft/models/bad.py", "from vlrft.strategies.base import Strategy\n"),
        ("vlrft/rollout/hf_engine.py", "from vlrft.strategies import make_strategy\n"),
        ("vlrft/models/prefix_decoding.py", "from vlrft.models.packing import pack_groups\n"),
        ("vlrft/strategies/config.py", "from vlrft.strategies.base import Strategy\n"),
        ("vlrft/rollout/hf_engine.py", "from vlrft.models.cpu_matmul import onednn_matmul\n"),
    ],
)
def test_a_forbidden_import_is_caught(tmp_path, monkeypatch, where, code):
    """The check fails on each kind of forbidden edge (a file written into a copy of the tree's layout)."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    path = tmp_path / where
    path.parent.mkdir(parents=True)
    path.write_text(code)
    assert len(violations([path])) == 1, violations([path])
