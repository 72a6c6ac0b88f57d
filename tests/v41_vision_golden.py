"""Shared helpers for the image tests: the committed small V4.1 checkpoint with a vision tower
(tests/data/v41_vision, PROVENANCE.md) and what the official code produced for it."""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from v41_golden import matching_set

V41_VISION = Path(__file__).parent / "data" / "v41_vision"
IMAGES = V41_VISION / "images"
# the images of each golden prompt, in placeholder order
PROMPT_IMAGES = {"one_image": ["rgb_small.png"], "two_images": ["gray_tall.png", "rgba.png"],
                 "mid_conversation": ["big.png"]}


def vision_golden() -> dict[str, torch.Tensor]:
    """The official numbers of the set produced on this kind of CPU (the first set when none was)."""
    sets = vision_meta()["sets"]
    return load_file(str(V41_VISION / (matching_set(sets) or sets[0])["file"]))


def vision_exact() -> bool:
    """Bit equality is expected: a set was produced on this kind of CPU."""
    return matching_set(vision_meta()["sets"]) is not None


def vision_meta() -> dict:
    return json.loads((V41_VISION / "golden.json").read_text())


def prompt_cut(gold: dict, case: str, cut: int) -> list[int]:
    """The placeholder prompt whose expansion is the first `cut` tokens (cuts lie after the last image)."""
    prompt = gold[f"prompt.{case}"].tolist()
    return prompt[: len(prompt) - (gold[f"tokens.{case}"].numel() - cut)]
