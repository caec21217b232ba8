"""Architecture names, known without importing transformers (keeps ``vlrft --help`` fast)."""

import importlib.util

ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen2") + (
    ("qwen3_vl",) if importlib.util.find_spec("transformers.models.qwen3_vl") is not None else ()
)
VL_ARCHS = tuple(a for a in ARCHS if a != "qwen2")
