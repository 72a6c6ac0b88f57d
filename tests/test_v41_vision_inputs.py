"""Image inputs: every kind of bad image refused with its own clear error through the Python API
and the CLI (exit 2, one line, before Ray starts), sessions untouched; the input forms (bytes,
path, PIL, data: URL; http(s) refused unless allowed); the v41-small preset's vision tower in the
released names and dtypes, used end to end from a text prompt with the image placeholder."""
import base64

import numpy as np
import pytest
import torch
from PIL import Image

from engramflow.cli.app import main
from engramflow.io.checkpoint import Checkpoint
from engramflow.model.v41.names import tensor_specs
from engramflow.model.v41.vision import ImageError, load_image_from_data_url
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.image_inputs import IMAGE_PLACEHOLDER
from v41_vision_golden import IMAGES, V41_VISION, vision_golden
from vision_bad_images import bad_images

pytestmark = pytest.mark.default_threads  # golden bits: torch's default thread count (conftest.py)

TOKEN = 510  # the small golden checkpoint's image placeholder id


@pytest.fixture(scope="module")
def engine():
    e = Engine(V41_VISION)
    yield e
    e.shutdown()


@pytest.mark.parametrize("what", sorted(bad_images()))
def test_bad_image_through_the_api_leaves_the_session_as_it_was(engine, what):
    data, kind = bad_images()[what]
    s = engine.open()
    engine.prefill(s, [5, 6, 7])
    with pytest.raises(ImageError) as err:
        engine.prefill(s, [1, TOKEN, 2], images=[data])
    assert err.value.kind == kind, (what, str(err.value))
    assert "image" in str(err.value)
    assert engine.tokens(s) == [5, 6, 7]
    good = engine.prefill(s, [1, TOKEN, 2], images=[IMAGES / "rgb_small.png"])  # still works
    assert torch.isfinite(good).all()
    engine.close(s)


def test_too_many_images_for_the_context(engine):
    s = engine.open()
    n = engine.cfg.max_seq_len // 8 + 1  # each image is at least an 8-token span here
    with pytest.raises(ImageError, match="max_seq_len") as err:
        engine.prefill(s, [TOKEN] * n, images=[IMAGES / "palette.gif"] * n)
    assert err.value.kind == "too_many_tokens" and engine.length(s) == 0
    with pytest.raises(ImageError, match="2 image placeholder") as err:
        engine.prefill(s, [TOKEN, 3, TOKEN], images=[IMAGES / "palette.gif"])
    assert err.value.kind == "placeholder_count"
    with pytest.raises(ImageError, match="cannot read image file"):
        engine.prefill(s, [TOKEN], images=[IMAGES / "missing.png"])
    assert engine.length(s) == 0
    engine.close(s)


def test_input_forms_agree(engine):
    gold = vision_golden()
    prompt, want = gold["prompt.one_image"].tolist(), gold["logits.one_image"][-1]
    data = (IMAGES / "rgb_small.png").read_bytes()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    with Image.open(IMAGES / "rgb_small.png") as img:
        img.load()
        forms = [data, str(IMAGES / "rgb_small.png"), img, load_image_from_data_url(url)]
        outs = []
        for form in forms:
            s = engine.open()
            outs.append(engine.prefill(s, prompt, images=[form]))
            engine.close(s)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert float((outs[0] - want).abs().max()) < 0.1 * float(want.abs().max())


def test_data_urls_and_remote_urls():
    assert load_image_from_data_url("data:image/png;base64," + base64.b64encode(b"abc").decode()) == b"abc"
    with pytest.raises(ImageError) as err:
        load_image_from_data_url("https://example.com/cat.png")
    assert err.value.kind == "remote_refused" and "refused" in str(err.value)
    for bad in ("data:image/png,rawbytes", "data:image/png;base64,@@@", "ftp://host/x.png", ""):
        with pytest.raises(ImageError):
            load_image_from_data_url(bad)


def test_text_checkpoint_refuses_images(tmp_path):
    from v41_golden import V41_SMALL

    e = Engine(V41_SMALL)
    try:
        s = e.open()
        with pytest.raises(Exception, match="no vision tower"):
            e.prefill(s, [1, 2], images=[IMAGES / "rgb_small.png"])
        assert e.length(s) == 0
    finally:
        e.shutdown()


def test_v41_small_preset_has_a_vision_tower_in_released_names(v41_small_preset):
    ckpt = Checkpoint(v41_small_preset)
    try:
        specs = tensor_specs(ckpt.raw_config)
        vision = {n: s for n, s in specs.items() if s.group == "vision" or n.endswith(".gate.bias_vl")}
        assert any(n.startswith("vision.blocks.1.") for n in vision) and "aligner.w1.weight" in vision
        assert {"image_start", "image_end", "image_newline", "layers.0.ffn.gate.bias_vl"} <= set(vision)
        for name, spec in vision.items():
            info = ckpt.tensors[name]
            assert info.dtype in spec.dtypes and tuple(info.shape) == spec.shape, name
    finally:
        ckpt.close()


def test_v41_small_preset_reads_an_image_from_a_text_prompt(v41_small_preset):
    e = Engine(v41_small_preset)
    try:
        prompt = f"Look: {IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}, then say"
        (g,) = e.generate([prompt], max_new_tokens=3, images=[[IMAGES / "rgba.png", IMAGES / "wide.png"]],
                          keep_sessions=True)
        ids = np.array(e.tokens(g.session))
        spans = (ids == e.vision_cfg.image_token_id).sum()
        assert spans == sum(e.vision.prepare(IMAGES / n).span_tokens for n in ("rgba.png", "wide.png"))
        assert len(g.tokens) == 3
    finally:
        e.shutdown()


@pytest.mark.parametrize("what", ["truncated", "not an image", "bomb above our limit", "absurd aspect"])
def test_bad_image_through_the_cli_exits_2_before_ray(v41_small_preset, tmp_path, capsys, what):
    data, kind = bad_images()[what]
    path = tmp_path / "bad.png"
    path.write_bytes(data)
    code = main(["generate", "--checkpoint", str(v41_small_preset), "--prompt", "see <image>", "--image", str(path),
                 "--address", "127.0.0.1:1"])  # an unreachable Ray: the image must be refused first
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "image" in err and "Traceback" not in err, err
    code = main(["generate", "--checkpoint", str(v41_small_preset), "--prompt", "no placeholder",
                 "--image", str(IMAGES / "rgb_small.png")])
    _, err = capsys.readouterr()
    assert code == 2 and "placeholder" in err, err


def test_cli_generate_with_an_image_equals_the_engine(v41_small_preset, ray_session, capsys):
    import json

    image = IMAGES / "rgba.png"
    code = main(["generate", "--checkpoint", str(v41_small_preset), "--prompt", "see <image> now",
                 "--image", str(image), "--max-new-tokens", "3", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    e = Engine(v41_small_preset)
    try:
        (want,) = e.generate([f"see {IMAGE_PLACEHOLDER} now"], max_new_tokens=3, images=[[image]])
    finally:
        e.shutdown()
    assert json.loads(out.strip().splitlines()[-1])["tokens"] == want.tokens
