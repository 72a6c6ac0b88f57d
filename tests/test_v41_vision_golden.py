"""Images through the v41 backbone against numbers the official DeepSeek V4.1 code produced
(tests/data/v41_vision): preprocessing patches, ViT and aligner features, prefill logits with one
image, two images and an image mid-conversation. Bit-equal where the machine matches the one
that produced them (a set of tests/data/v41_vision/golden.json for this CPU kind), close otherwise."""
import hashlib

import numpy as np
import pytest
import torch

from engramflow.io.checkpoint import Checkpoint
from engramflow.model.v41.vision.encoder import VisionEncoder
from engramflow.pipeline.engine import Engine
from v41_golden import clear_margin, rel_diff
from v41_vision_golden import IMAGES, PROMPT_IMAGES, V41_VISION, prompt_cut, vision_exact, vision_golden, vision_meta

pytestmark = pytest.mark.default_threads  # golden bits: torch's default thread count (conftest.py)

EXACT = vision_exact()


@pytest.fixture(scope="module")
def gold():
    return vision_golden()


@pytest.fixture(scope="module")
def encoder():
    ckpt = Checkpoint(V41_VISION)
    yield VisionEncoder(ckpt)
    ckpt.close()


@pytest.fixture(scope="module")
def engine():
    e = Engine(V41_VISION, backbone="v41", numerics="official")
    yield e
    e.shutdown()


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("name", sorted(vision_meta()["images"]))
def test_patches_equal_official(encoder, name):
    want = vision_meta()["images"][name]
    got = encoder.prepare(IMAGES / name)
    g = got.grid
    assert [g.vit_h, g.vit_w] == want["vit_grid"] and [g.llm_h, g.llm_w] == want["llm_grid"], name
    assert list(got.patches.shape) == want["patches_shape"] and got.patches.dtype == torch.bfloat16
    assert got.span_tokens == want["span_tokens"]
    assert _sha(got.patches) == want["patches_sha256"], f"{name}: patch bytes differ from the official ones"


def test_pil_and_bytes_inputs_give_the_same_patches(encoder):
    from PIL import Image

    for name in ("rgba.png", "gray_tall.png", "exif_rotated.jpg"):
        from_path = encoder.prepare(IMAGES / name).patches
        from_bytes = encoder.prepare((IMAGES / name).read_bytes()).patches
        with Image.open(IMAGES / name) as img:
            img.load()
            from_pil = encoder.prepare(img).patches
        assert torch.equal(from_path, from_bytes) and torch.equal(from_path, from_pil), name


@pytest.mark.parametrize("name", sorted(vision_meta()["images"]))
def test_vit_and_aligner_features(encoder, gold, name):
    img = encoder.prepare(IMAGES / name)
    g, stem = img.grid, name.split(".")[0]
    vit = encoder.tower.vit(img.patches, g.vit_h, g.vit_w)
    feats = encoder.tower.align(vit, g.vit_h, g.vit_w)
    for got, want, what in ((vit, gold[f"vit.{stem}"], "ViT"), (feats, gold[f"features.{stem}"], "aligner")):
        assert got.shape == want.shape and got.dtype == want.dtype, (name, what)
        if EXACT:
            assert torch.equal(got, want), f"{name}: {what} max |diff| {(got.float() - want.float()).abs().max():.3e}"
        else:
            assert rel_diff(got.float(), want.float()) < 0.05, (name, what)


def check(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    if EXACT:
        assert torch.equal(got, want), f"{where}: max |diff| {float((got - want).abs().max()):.3e}"
    else:
        assert rel_diff(got, want) < 0.1, where
        if clear_margin(want):
            assert got.argmax() == want.argmax(), where


@pytest.mark.parametrize("case", sorted(PROMPT_IMAGES))
def test_prefill_logits_with_images(engine, gold, case):
    images = [IMAGES / n for n in PROMPT_IMAGES[case]]
    for row, cut in enumerate(gold[f"cuts.{case}"].tolist()):
        s = engine.open()
        got = engine.prefill(s, prompt_cut(gold, case, cut), images=images)
        assert engine.tokens(s) == gold[f"tokens.{case}"][:cut].tolist(), f"{case}: span layout"
        check(got, gold[f"logits.{case}"][row], f"{case}, {cut} tokens")
        engine.close(s)


def test_text_only_prompt_on_the_vision_checkpoint(engine, gold):
    s = engine.open()
    check(engine.prefill(s, gold["prompt.text_only"].tolist()), gold["logits.text_only"][0], "text only")
    engine.close(s)


def test_image_tokens_route_with_bias_vl(engine, gold):
    """The MoE picks experts with bias_vl inside image spans: some image tokens change experts."""
    stage = engine.stage
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((64, stage.v41.dim))).to(torch.bfloat16)
    moe = stage.layers[0].moe
    assert moe.w.bias_vl is not None and not torch.equal(moe.w.bias_vl, moe.w.bias)
    _, text = moe.route(x)
    _, image = moe.route(x, torch.ones(64, dtype=torch.bool))
    _, mixed = moe.route(x, torch.arange(64) < 32)
    assert not torch.equal(text, image)
    assert torch.equal(mixed[:32], image[:32]) and torch.equal(mixed[32:], text[32:])
