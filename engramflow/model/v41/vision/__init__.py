"""Images in, as DeepSeek V4.1 reads them: preprocessing, the ViT + aligner, image spans."""
from engramflow.model.v41.vision.errors import ImageError
from engramflow.model.v41.vision.sources import load_image_from_data_url

__all__ = ["ImageError", "load_image_from_data_url"]
