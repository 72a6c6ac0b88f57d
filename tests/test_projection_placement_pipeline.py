"""Host and stage projection give the same tokens (and logits) with every backbone, and the
bytes that crossed to the stages are counted per layer. Real Ray, real actors."""
import json
from pathlib import Path

import pytest
import torch

from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import Checkpoint
from engramflow.pipeline.placement_calibration import bytes_per_token
from engramflow.pipeline.pipeline import Pipeline

V41_SMALL = Path(__file__).parent / "data" / "v41_small"
PROMPT = [101, 7, 205, 33, 12, 409, 88, 5, 19, 64, 3, 77]  # < 512: the v41_small vocabulary


def run(ckpt, backbone, projection, stages=2, **kw):
    pipe = Pipeline.launch(ckpt, stages=stages, backbone=backbone, block_ms=0.2, projection=projection,
                           prefill_chunk=5, **kw)
    try:
        s = pipe.open()
        logits = [pipe.prefill(s, PROMPT)]
        tokens = []
        for _ in range(4):
            tokens.append(int(logits[-1].argmax()))
            logits.append(pipe.decode_step({s: tokens[-1]})[s])
        return tokens, logits, dict(pipe.bytes_moved), pipe.placement.counts
    finally:
        pipe.shutdown()


# "auto" with injected rates: a host far slower than the stage sends rows; the reverse, K/V
LINK = {"latency_s": 1e-4, "bytes_per_s": 1e9}
SLOW, FAST = {"decode_s": 1.0, "per_token_s": 1.0}, {"decode_s": 1e-6, "per_token_s": 1e-9}
WAYS = {"host": {"projection": "host"}, "stage": {"projection": "stage"},
        "auto->host": {"projection": "auto", "placement_rates": {"host": FAST, "stage": SLOW, "link": LINK}},
        "auto->stage": {"projection": "auto", "placement_rates": {"host": SLOW, "stage": FAST, "link": LINK}}}


@pytest.mark.parametrize("backbone, ways", [("reference", ("auto->host", "auto->stage")),
                                            ("emulated", ("host", "stage")), ("v41", ("host", "stage"))],
                         ids=["reference-auto", "emulated", "v41"])
def test_host_and_stage_projection_agree(backbone, ways, tiny_ckpt, ray_session):
    """Host and stage projection, named or chosen by "auto" from injected rates (which it then
    follows at every step): the same tokens and logits, and what crossed counted per layer."""
    ckpt = V41_SMALL if backbone == "v41" else tiny_ckpt
    host_tokens, host_logits, host_bytes, host_counts = run(ckpt, backbone, **WAYS[ways[0]])
    stage_tokens, stage_logits, stage_bytes, counts = run(ckpt, backbone, **WAYS[ways[1]])
    assert stage_tokens == host_tokens
    for a, b in zip(host_logits, stage_logits):
        # CPU stages project with the same kernels on the same rows: the same bits
        assert torch.equal(a, b)
    # what crossed: fp32 K/V or MXFP8 rows of every position written (12 prompt + 4 decoded)
    kv, rows = bytes_per_token(Checkpoint(ckpt).config)
    n = len(PROMPT) + 4
    assert host_bytes == {layer: n * kv for layer in host_bytes} and host_bytes
    assert stage_bytes == {layer: n * rows for layer in host_bytes}
    for layer in host_bytes:
        assert counts[layer]["stage"] > 0 and counts[layer]["host"] == 0
        assert host_counts[layer]["host"] > 0 and host_counts[layer]["stage"] == 0


def test_auto_measures_and_decodes_on_the_host_here(tiny_ckpt, ray_session):
    """Measured at launch on this one node (CPU stage): decode steps are projected on the host."""
    pipe = Pipeline.launch(tiny_ckpt, stages=1, backbone="reference", projection="auto")
    try:
        rates = pipe.placement.model.describe()
        assert rates["host"]["decode_s"] > 0 and rates["link"]["bytes_per_s"] > 0
        s = pipe.open()
        pipe.prefill(s, PROMPT)
        before = {layer: dict(c) for layer, c in pipe.placement.counts.items()}
        for t in (5, 6, 7):
            pipe.decode_step({s: t})
        for layer, c in pipe.placement.counts.items():
            assert c["host"] - before[layer]["host"] == 3
    finally:
        pipe.shutdown()


@pytest.mark.parametrize("bad", ["gpu", "", None, "HOST"])
def test_bad_projection_names_are_refused(bad, tiny_ckpt):
    with pytest.raises(EngramflowError, match="projection must be one of host, stage, auto"):
        Pipeline.launch(tiny_ckpt, projection=bad)


def test_bad_rates_are_refused(tiny_ckpt):
    with pytest.raises(EngramflowError, match="placement rates take the keys"):
        Pipeline.launch(tiny_ckpt, projection="auto", placement_rates={"gpu": 1})


def test_generate_json_reports_bytes_moved(tiny_ckpt, ray_session, capsys):
    """`generate --projection stage --json`: the in-process Engine's tokens, and the MXFP8 rows of
    every position written per layer (the prompt and 2 decoded tokens; the third is only
    sampled). The K/V bytes of host projection: test_host_and_stage_projection_agree."""
    from engramflow.cli.app import main
    from engramflow.pipeline.engine import Engine

    assert main(["generate", "--checkpoint", str(tiny_ckpt), "--prompt", "Engram rows", "--max-new-tokens", "3",
                 "--projection", "stage", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    engine = Engine(tiny_ckpt)
    try:
        prompt = engine.encode("Engram rows")
        assert doc["tokens"] == engine.generate([prompt], max_new_tokens=3)[0].tokens
    finally:
        engine.shutdown()
    cfg = Checkpoint(tiny_ckpt).config
    _, rows = bytes_per_token(cfg)
    assert doc["bytes_moved"] == {str(layer): (len(prompt) + 2) * rows for layer in cfg.engram_layer_ids}
