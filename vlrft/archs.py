"""Architecture names, known without importing transformers (keeps ``vlrft --help`` fast)."""

import importlib.util
from pathlib import Path


def _has_transformers_model(name: str) -> bool:
    """Whether the installed transformers ships ``transformers.models.<name>``: its folder is looked up, not imported
    (``find_spec`` of a submodule imports the parent packages, which costs seconds)."""
    spec = importlib.util.find_spec("transformers")
    return any((Path(p) / "models" / name / "__init__.py").is_file() for p in (spec.submodule_search_locations or ()))


# the architectures (config.json's model_type) vlrft trains, each proven by the tests on a tiny model of it; ARCHS:
# those the installed transformers has (Qwen3-VL, dense and mixture-of-experts, and Qwen3.5, hybrid linear attention,
# dense and mixture-of-experts, came in later releases)
KNOWN_ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen2", "qwen3", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
ARCHS = KNOWN_ARCHS[:4] + tuple(a for a in KNOWN_ARCHS[4:] if _has_transformers_model(a))
TEXT_ARCHS = ("qwen2", "qwen3")  # text-only Qwen (Qwen2 / Qwen2.5 and Qwen3 language models)
VL_ARCHS = tuple(a for a in ARCHS if a not in TEXT_ARCHS)
