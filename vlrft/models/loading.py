"""The one loader of model folders: policies, judges, reward-model backbones and critics, with their processors.

``load_model(path)`` returns ``(model, processor)``: a checkpoint whose config has a ``vision_config``
gives ``AutoModelForImageTextToText`` + ``AutoProcessor``, any other ``AutoModelForCausalLM`` +
``AutoTokenizer``. With ``lm_head=False`` the model is the base model that ``AutoModel`` builds (the
scalar reward model's backbone); with ``processor=False`` no processor is read (``None`` comes back).

``path`` is an HF model folder, a ``train-policy`` run folder (its ``final/`` model is read) or a
hub id, which is looked up only when online or already in the local cache. Importing this module
imports ``vlrft.models``, which registers the image-only Qwen-VL processors, so tiny model folders load
on machines without torchvision.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import try_to_load_from_cache
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
)
from transformers import __version__ as TRANSFORMERS_VERSION

from data_pipelines.sources import FILE_FORMATS
from vlrft.archs import ARCHS, KNOWN_ARCHS
from vlrft.config import ConfigError, option
from vlrft.errors import ModelFolderError
from vlrft.models import processing
from vlrft.models.attention_functions import use_varlen_vision_attention
from vlrft.models.patch_embedding import use_linear_patch_embedding


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def _cached(repo_id: str) -> bool:
    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid hub id (e.g. a missing absolute path)
        return False


def resolve_model_path(path: str | Path) -> str:
    """The folder (or hub id) to load ``path`` from: a folder with ``config.json``, else a run folder's
    ``final/`` model (``vlrft train-policy``; ``model/`` of ``vlrft train-reward-model``); a training
    checkpoint (``step-NNNNNN``: sharded training state, no model files) is refused with the folder to use
    instead; a name that is no folder is a hub id, refused offline unless it is cached."""

    folder = Path(path).expanduser()
    if folder.exists():
        if (folder / "config.json").is_file():
            return str(folder)
        for sub in ("final", "model"):
            if (folder / sub / "config.json").is_file():
                return str(folder / sub)
        if folder.name.startswith("step-") or (folder / "COMPLETE").is_file():
            run = folder.parent.parent if folder.parent.name.endswith("checkpoints") else folder.parent
            raise FileNotFoundError(
                f"{path}: a training checkpoint (sharded training state), not a model folder; use the run "
                f"folder {run} (its final/ model, written when training ends: resume the run with "
                "train.resume=auto to finish it) or any folder written by save_pretrained"
            )
        raise FileNotFoundError(
            f"{path}: no config.json there (nor in a final/ subfolder); want an HF model folder or a "
            "train-policy run folder"
        )
    if _offline() and not _cached(str(path)):
        raise FileNotFoundError(f"{path}: no such folder, and hub ids need the network (HF_HUB_OFFLINE is set)")
    return str(path)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def path_like(value: str) -> bool:
    """Whether ``value`` was meant as a local path rather than a hub id (``org/name``)."""
    return (
        value.startswith(("/", ".", "~"))
        or value.count("/") > 1
        or value.endswith("/")
        or "\\" in value
        or Path(value).suffix.lower() in FILE_FORMATS
    )


def check_model_folder(path: str, key: str) -> dict[str, Any] | None:
    """The ``config.json`` of the model folder ``path`` (``key`` names the config key in errors), or
    ``None`` for a hub id (which must be cached when offline)."""
    folder = Path(path).expanduser()
    if not folder.exists():
        if path_like(path):
            raise ConfigError(f"{key}={path}: no such folder")
        if _offline() and not _cached(path):
            raise ConfigError(
                f"{key}={path}: no such folder, and as a hub id it is not in the local cache (HF_HUB_OFFLINE is set)"
            )
        return None
    if not folder.is_dir():
        raise ConfigError(f"{key}={path}: not a folder (want an HF model folder with config.json)")
    if not (folder / "config.json").is_file():
        hint = next(
            (f"; use {folder / sub}" for sub in ("final", "hf", "model") if (folder / sub / "config.json").is_file()),
            "; want an HF model folder (save_pretrained)",
        )
        raise ConfigError(f"{key}={path}: no config.json in this folder{hint}")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}={path}: config.json is not readable JSON ({exc})") from exc
    why = weights_problem(folder)
    if why is not None:
        raise ConfigError(f"{key}={path}: {why}; copy the model again or export it again")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"{key}={path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the tokenizer (or processor) "
            "next to the model, e.g. copy them from the base model"
        )
    if config.get("vision_config") is not None and not any((folder / n).is_file() for n in PROCESSOR_FILES):
        raise ConfigError(
            f"{key}={path}: a vision-language model without processor files ({', '.join(PROCESSOR_FILES)}); "
            "save its processor next to it (processor.save_pretrained)"
        )
    return config


def check_trainable(model_type: Any, where: str) -> None:
    """The model of a training run (policy, SFT, DPO, reward model) is of an architecture vlrft trains: its
    ``config.json``'s ``model_type`` one of :data:`vlrft.archs.ARCHS`. Anything else is one line naming it and them
    (``where``: the config key and value), before the run: the group-shared forward, the vision inputs and the
    decoding cache are built and proven for those (docs/tiny-models.md)."""
    if model_type in ARCHS:
        return
    trains = ", ".join(ARCHS)
    if model_type in KNOWN_ARCHS:
        raise ConfigError(
            f"{where}: architecture {model_type!r} needs a newer transformers than the installed "
            f"{TRANSFORMERS_VERSION} (5.24 has it); with this one vlrft trains {trains}"
        )
    raise ConfigError(
        f"{where}: architecture {model_type!r} (config.json's model_type) is not one vlrft trains; it trains {trains}"
    )


def folder_config(path: str, key: str) -> dict[str, Any] | None:
    """:func:`check_model_folder`'s ``config.json`` of ``path``, or a hub id's from the local cache; ``None`` for a
    hub id not at hand (read when it loads)."""
    config = check_model_folder(path, key)
    if config is None and _cached(path):
        try:
            config = json.loads(Path(try_to_load_from_cache(path, "config.json")).read_text())
        except (OSError, ValueError):
            return None
    return config


@dataclass
class ModelConfig:
    """The model section of every trainer: the model to start from."""

    path: str = option("", "HF model folder or hub id (online, or cached); empty: build a tiny model", reads=True)
    tiny_arch: str = option("qwen2_5_vl", "architecture of the tiny model built when path is empty", choices=ARCHS)
    tiny_hidden: int = option(64, "hidden size of that tiny model", ge=8)
    tiny_layers: int = option(2, "decoder layers of that tiny model", ge=1)
    dtype: str = option("float32", "parameter dtype when loading", choices=("float32", "bfloat16"))


def torch_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"float32"``, ``"bfloat16"`` (any torch dtype name) or a torch dtype; ``None`` stays ``None``
    (the checkpoint's own dtype, as transformers decides)."""

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; want e.g. 'float32' or 'bfloat16'")
    return value


def weights_problem(folder: str | Path) -> str | None:
    """Why the safetensors weights of the model folder ``folder`` cannot be read whole, from the files' headers
    alone (no tensor is read): a file shorter or longer than its header says (a copy or an export cut off), a
    header that is not safetensors, a shard the index lists that is missing. None when they look whole."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            return f"{index.name} is not a readable shard index ({exc})"
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            return f"{index.name} lists {', '.join(missing[:3])}, which {'is' if len(missing) == 1 else 'are'} missing"
    for f in sorted(folder.glob("*.safetensors")):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little") if size >= 8 else -1
            if not 0 < n <= size - 8:
                return f"{f.name} ({size} bytes) is truncated or not a safetensors file: no whole header"
            try:
                header = json.loads(fh.read(n))
                end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            except (ValueError, KeyError, TypeError, IndexError):
                return f"{f.name} ({size} bytes) is not a safetensors file (its header does not parse)"
        if size != 8 + n + end:
            return (
                f"{f.name} holds {size} bytes but its header describes {8 + n + end}: "
                f"{'truncated' if size < 8 + n + end else 'damaged'} (an interrupted copy or export?)"
            )
    return None


def _config(path: str | Path, trust_remote_code: bool, trains: str | None = None) -> tuple[str, bool]:
    name = resolve_model_path(path)
    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    if trains is not None:
        check_trainable(config.model_type, f"{trains}={path}")
    return name, getattr(config, "vision_config", None) is not None


def _image_only_class(name: str) -> Any:
    """The image-only processor class a local folder's ``processor_config.json`` names, else ``None``.

    ``AutoProcessor.register`` is a no-op for a native transformers config class in some releases
    (5.17, the CUDA image's), and ``AutoProcessor`` then silently returns the bare tokenizer."""
    path = Path(name) / "processor_config.json"
    if not path.is_file():
        return None
    try:
        cls_name = json.loads(path.read_text()).get("processor_class", "")
    except (OSError, ValueError):
        return None
    cls = getattr(processing, cls_name, None) if cls_name.startswith("ImageOnly") else None
    return cls if isinstance(cls, type) else None


def _processor(name: str, vision_language: bool, trust_remote_code: bool) -> Any:
    image_only = _image_only_class(name) if vision_language else None
    if image_only is not None:
        return image_only.from_pretrained(name)
    auto = AutoProcessor if vision_language else AutoTokenizer
    return auto.from_pretrained(name, trust_remote_code=trust_remote_code)


def load_processor(path: str | Path, *, trust_remote_code: bool = False) -> Any:
    """The processor of a Qwen-VL folder, or the tokenizer of a text-only one (no weights read)."""

    name, vl = _config(path, trust_remote_code)
    return _processor(name, vl, trust_remote_code)


def load_model(
    path: str | Path,
    dtype: str | torch.dtype | None = "float32",
    device: str | torch.device | None = None,
    *,
    trust_remote_code: bool = False,
    lm_head: bool = True,
    processor: bool = True,
    trains: str | None = None,
) -> tuple[torch.nn.Module, Any]:
    """``(model, processor)`` of a model folder (see the module doc); the model on ``device`` if given. ``trains``:
    the config key the path came from, for a model a run trains (:func:`check_trainable`, before any weight loads:
    a hub id the preflight could not read)."""

    name, vl = _config(path, trust_remote_code, trains)
    why = weights_problem(name) if Path(name).is_dir() else None  # before transformers reads a cut-off file
    if why is not None:
        raise ModelFolderError(f"{path}: {why}; copy the model again or export it again")
    auto = AutoModel if not lm_head else AutoModelForImageTextToText if vl else AutoModelForCausalLM
    model = auto.from_pretrained(name, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code)
    use_varlen_vision_attention(model)  # an SDPA vision tower: one attention call per window length, not per window
    use_linear_patch_embedding(model)  # the patch convolution as the matrix product it is
    if device is not None:
        model = model.to(device)
    return model, _processor(name, vl, trust_remote_code) if processor else None
