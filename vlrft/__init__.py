"""vlrft: multimodal reward modeling and reinforcement fine-tuning for Qwen-VL policies.

``import vlrft.models`` (done by every vlrft loader) registers the image-only Qwen-VL processors with
``AutoProcessor``, so tiny model folders load on machines without torchvision.
"""

__version__ = "0.1.0"
