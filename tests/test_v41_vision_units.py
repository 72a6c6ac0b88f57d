"""The pieces of the image path on their own: the size plan's invariants on fresh random sizes,
span layout and slicing, and chunked prefill cutting image spans (it must track the official
one-shot logits as closely as chunking text does)."""
import dataclasses
import math

import pytest
import torch

from engramflow.model.v41.vision.config import vision_from_dict
from engramflow.model.v41.vision.grid import plan_grid, span_tokens
from engramflow.model.v41.vision.spans import END, IMAGE, NEW_LINE, START, ImageSlot, clip_slots, span_rows, span_types
from engramflow.pipeline.engine import Engine
from v41_golden import clear_margin, rel_diff
from v41_vision_golden import IMAGES, PROMPT_IMAGES, V41_VISION, prompt_cut, vision_golden

pytestmark = pytest.mark.default_threads  # golden bits: torch's default thread count (conftest.py)

RELEASED = {"vision_n_layers": 32, "vision_dim": 1024, "vision_n_heads": 16, "vision_max_n_token": 1024,
            "vision_min_pixels": 295936, "vision_max_wh_ratio": None}


@pytest.mark.parametrize("budget", [10, 40, 1024])
def test_plan_invariants_on_random_sizes(rng, budget):
    cfg = dataclasses.replace(vision_from_dict(RELEASED, 5120), max_n_token=budget)
    for _ in range(300):
        w, h = (int(v) for v in rng.integers(1, 5000, 2))
        g = plan_grid(w, h, cfg)
        assert g.span_tokens <= budget, (w, h, g)
        assert g.width % 14 == 0 and g.height % 14 == 0 and g.vit_w == g.width // 14 and g.vit_h == g.height // 14
        assert (g.llm_h, g.llm_w) == (math.ceil(g.vit_h / 3), math.ceil(g.vit_w / 3))
        assert g.vit_h >= 1 and g.vit_w >= 1
        if w * h >= cfg.min_pixels and span_tokens(math.ceil(math.ceil(h / 14) / 3), math.ceil(math.ceil(w / 14) / 3)) <= budget:
            assert (g.width, g.height) == (math.ceil(w / 14) * 14, math.ceil(h / 14) * 14)  # no resize needed


def test_small_images_scale_up_to_min_pixels():
    cfg = vision_from_dict(RELEASED, 5120)
    g = plan_grid(40, 30, cfg)
    assert g.width * g.height >= cfg.min_pixels and abs(g.width / g.height - 40 / 30) < 0.05


def test_span_layout_and_rows():
    assert span_types(2, 3) == [START] + [IMAGE] * 3 + [NEW_LINE] + [IMAGE] * 3 + [NEW_LINE] + [END]
    feats = torch.arange(6 * 4, dtype=torch.float32).view(6, 4).bfloat16()
    delim = {k: torch.full((4,), v, dtype=torch.bfloat16) for k, v in
             (("image_start", -1.0), ("image_newline", -2.0), ("image_end", -3.0))}
    rows = span_rows(feats, 2, 3, delim)
    assert rows.shape == (span_tokens(2, 3), 4)
    assert rows[:, 0].tolist() == [-1, 0, 4, 8, -2, 12, 16, 20, -2, -3]


def test_slot_slicing_keeps_the_rows_exact():
    rows = torch.arange(10).view(10, 1)
    slot = ImageSlot(3, 10, rows)  # positions 3..12 of a request
    pieces = [clip_slots([slot], a, a + 4) for a in range(0, 16, 4)]
    got = torch.cat([p.rows[p.skip:p.skip + p.n] for chunk in pieces for p in chunk])
    assert torch.equal(got, rows)
    assert clip_slots([slot], 13, 20) == () and clip_slots([slot], 0, 3) == ()
    assert [(p.start, p.n, p.skip) for chunk in pieces for p in chunk] == [(3, 1, 0), (0, 4, 1), (0, 4, 5), (0, 1, 9)]


def test_chunked_prefill_cuts_spans_and_tracks_one_shot():
    gold = vision_golden()
    e = Engine(V41_VISION, prefill_chunk=7, numerics="official")  # against the official bits
    try:
        for case, names in PROMPT_IMAGES.items():
            cut = gold[f"cuts.{case}"][-1].item()
            s = e.open()
            got = e.prefill(s, prompt_cut(gold, case, cut), images=[IMAGES / n for n in names])
            want = gold[f"logits.{case}"][-1]
            assert e.tokens(s) == gold[f"tokens.{case}"].tolist()
            assert rel_diff(got, want) < 0.1, case
            if clear_margin(want):
                assert got.argmax() == want.argmax(), case
            e.close(s)
    finally:
        e.shutdown()
