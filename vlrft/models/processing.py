"""Qwen-VL processors that work without torchvision.

transformers 5.x's Qwen-VL processors insist on a video processor, and every video processor imports
torchvision, which has no CPU build. The subclasses below take no video processor from the folder and use
vlrft's own (``data_pipelines.video.QwenVideoProcessor``: PyAV and numpy, same outputs); registering them
with ``AutoProcessor`` makes ``AutoProcessor.from_pretrained`` work on such machines. Where torchvision
imports, the stock processors are left alone.
"""

from __future__ import annotations

import importlib.util

from transformers import (
    AutoProcessor,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLProcessor,
)

from data_pipelines.video import QwenVideoProcessor

try:
    from transformers import Qwen3VLConfig, Qwen3VLProcessor
except ImportError:  # older transformers
    Qwen3VLConfig = Qwen3VLProcessor = None
try:  # Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE: transformers builds Qwen3-VL's processor for them
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3VLMoeConfig
except ImportError:  # older transformers
    Qwen3_5Config = Qwen3_5MoeConfig = Qwen3VLMoeConfig = None


def torchvision_available() -> bool:
    """True when torchvision imports (the CUDA-only wheel on a CPU machine does not)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:
        return False
    return True


def _image_only(base):
    class ImageOnlyProcessor(base):
        # ProcessorMixin reads its sub-processors off this signature: no video_processor here.
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            kwargs.pop("video_processor", None)
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
            self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
            self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)
            # videos through vlrft's own processor (PyAV + numpy), on the image processor's patch grid
            self.video_processor = QwenVideoProcessor.like(image_processor) if image_processor is not None else None

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = "ImageOnly" + base.__name__
    return ImageOnlyProcessor


ImageOnlyQwen2VLProcessor = _image_only(Qwen2VLProcessor)
ImageOnlyQwen2_5_VLProcessor = _image_only(Qwen2_5_VLProcessor)
ImageOnlyQwen3VLProcessor = _image_only(Qwen3VLProcessor) if Qwen3VLProcessor is not None else None


# stock processor class -> its image-only subclass (an engine that builds the stock class itself gets this)
IMAGE_ONLY_PROCESSORS = {Qwen2VLProcessor: ImageOnlyQwen2VLProcessor, Qwen2_5_VLProcessor: ImageOnlyQwen2_5_VLProcessor}
if Qwen3VLProcessor is not None:
    IMAGE_ONLY_PROCESSORS[Qwen3VLProcessor] = ImageOnlyQwen3VLProcessor


def register_image_only_processors() -> None:
    """Make ``AutoProcessor`` know the image-only processors (tiny models are saved with them).

    Registered on every machine, so a tiny model folder loads wherever vlrft is imported; checkpoints
    of real models name the stock processor class in their config and keep getting it.
    """
    pairs = [(Qwen2VLConfig, ImageOnlyQwen2VLProcessor), (Qwen2_5_VLConfig, ImageOnlyQwen2_5_VLProcessor)]
    qwen3_family = (Qwen3VLConfig, Qwen3VLMoeConfig, Qwen3_5Config, Qwen3_5MoeConfig)
    pairs += [(c, ImageOnlyQwen3VLProcessor) for c in qwen3_family if c is not None and Qwen3VLProcessor is not None]
    for config_cls, proc_cls in pairs:
        AutoProcessor.register(config_cls, proc_cls, exist_ok=True)
