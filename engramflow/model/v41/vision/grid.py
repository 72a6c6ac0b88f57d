"""How big an image becomes: the pixel size it is resized to, its ViT patch grid and the token grid
the 3x3 aligner makes of it, within the model's limits. Pure arithmetic, no pixels.

The rules, as the official preprocessing applies them (the float operations are kept in the same
order so the sizes agree to the pixel):
1. a width above `max_wh_ratio` x height (when set) counts as that width;
2. an image smaller than `min_pixels` is scaled up (aspect kept, sizes truncated to integers);
3. each side is rounded UP to a whole number of patches;
4. if the span this costs (rows x (columns + 1 newline) + start + end) is above `max_n_token`,
   the largest aspect-preserving size that fits is used instead; a shape too tall or too wide to
   fit even one cell per row/column collapses to a single column or row.
"""
from __future__ import annotations

import dataclasses
import math

from engramflow.model.v41.vision.config import VisionConfig


@dataclasses.dataclass(frozen=True)
class ImageGrid:
    height: int   # pixels after resize (a multiple of the patch size)
    width: int
    vit_h: int    # patch grid
    vit_w: int
    llm_h: int    # token grid after the aligner (ceil of patches / downsample)
    llm_w: int

    @property
    def span_tokens(self) -> int:
        return span_tokens(self.llm_h, self.llm_w)


def span_tokens(llm_h: int, llm_w: int) -> int:
    """START + (llm_w IMAGE + NEW_LINE) per row + END."""
    return llm_h * (llm_w + 1) + 2


def _token_grid(height: int, width: int, patch: int, down: int) -> tuple[int, int]:
    return math.ceil((height // patch) / down), math.ceil((width // patch) / down)


def _fit_budget(height: float, width: float, patch: int, down: int, budget: int) -> tuple[int, int]:
    """The largest patch-aligned size of this aspect whose span fits `budget` tokens."""
    aspect = height / width
    cols = math.sqrt((budget - 2) / aspect + 0.25) - 0.5  # solves rows*(cols+1)+2 = budget, rows = cols*aspect
    rows = cols * aspect
    cell = patch * down
    if cols < 1.0:
        return (budget - 2) // 2 * cell, cell
    if rows < 1.0:
        return cell, (budget - 3) * cell
    scale = min(math.floor(cols) * cell / width, math.floor(rows) * cell / height)
    return math.floor(height * scale / patch) * patch, math.floor(width * scale / patch) * patch


def plan_grid(width: int, height: int, cfg: VisionConfig) -> ImageGrid:
    p, down = cfg.patch_size, cfg.downsample_ratio
    w, h = width, height
    if cfg.max_wh_ratio is not None and w > h * cfg.max_wh_ratio:
        w = h * cfg.max_wh_ratio
    if 0 < w * h < cfg.min_pixels:
        up = (cfg.min_pixels / (w * h)) ** 0.5
        w, h = int(w * up), int(h * up)
    best_w, best_h = math.ceil(w / p) * p, math.ceil(h / p) * p
    llm_h, llm_w = _token_grid(best_h, best_w, p, down)
    if span_tokens(llm_h, llm_w) > cfg.max_n_token:
        best_h, best_w = _fit_budget(h, w, p, down, cfg.max_n_token)
        llm_h, llm_w = _token_grid(best_h, best_w, p, down)
    return ImageGrid(best_h, best_w, best_h // p, best_w // p, llm_h, llm_w)
