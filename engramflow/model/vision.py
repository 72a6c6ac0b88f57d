"""The model's image side as the rest of the engine sees it: image sources and checks, the
preprocessed image, the span slots a prompt's placeholders become, and the encoder a stage runs.
Its one implementation is the V4.1 vision tower (model/v41/vision/); packages outside model/
import this module, never v41's own, so another model's tower would plug in here."""
from engramflow.model.v41.vision.config import VisionConfig
from engramflow.model.v41.vision.encoder import VisionEncoder, has_vision, require_vision, vision_config
from engramflow.model.v41.vision.errors import ImageError
from engramflow.model.v41.vision.preprocess import PreparedImage
from engramflow.model.v41.vision.sources import load_image_from_data_url, prepare_any
from engramflow.model.v41.vision.spans import ImageSlot, clip_slots

__all__ = ["ImageError", "ImageSlot", "PreparedImage", "VisionConfig", "VisionEncoder", "clip_slots", "has_vision",
           "load_image_from_data_url", "prepare_any", "require_vision", "vision_config"]
