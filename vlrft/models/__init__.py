"""Model building and loading: tiny models from config, processors that work without torchvision."""

from vlrft.models.processing import register_image_only_processors

register_image_only_processors()
