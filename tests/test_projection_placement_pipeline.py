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


@pytest.mark.parametrize("backbone", ["reference", "emulated", "v41"])
def test_host_and_stage_projection_agree(backbone, tiny_ckpt, ray_session):
    ckpt = V41_SMALL if backbone == "v41" else tiny_ckpt
    host_tokens, host_logits, host_bytes, _ = run(ckpt, backbone, "host")
    stage_tokens, stage_logits, stage_bytes, counts = run(ckpt, backbone, "stage")
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


def test_auto_with_injected_rates_follows_them(tiny_ckpt, ray_session):
    """Injected rates: a host far slower than the stage sends rows; the reverse sends K/V."""
    link = {"latency_s": 1e-4, "bytes_per_s": 1e9}
    slow, fast = {"decode_s": 1.0, "per_token_s": 1.0}, {"decode_s": 1e-6, "per_token_s": 1e-9}
    _, _, _, to_stage = run(tiny_ckpt, "reference", "auto", placement_rates={"host": slow, "stage": fast, "link": link})
    tokens_h, _, bytes_h, to_host = run(tiny_ckpt, "reference", "auto",
                                        placement_rates={"host": fast, "stage": slow, "link": link})
    assert all(c["host"] == 0 and c["stage"] > 0 for c in to_stage.values())
    assert all(c["stage"] == 0 and c["host"] > 0 for c in to_host.values())


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
    from engramflow.cli.app import main

    docs = {}
    for projection in ("host", "stage"):
        assert main(["generate", "--checkpoint", str(tiny_ckpt), "--prompt", "Engram rows", "--max-new-tokens", "3",
                     "--projection", projection, "--json"]) == 0
        docs[projection] = json.loads(capsys.readouterr().out)
    assert docs["host"]["tokens"] == docs["stage"]["tokens"]
    cfg = Checkpoint(tiny_ckpt).config
    kv, rows = bytes_per_token(cfg)
    layers = {str(layer) for layer in cfg.engram_layer_ids}
    assert set(docs["host"]["bytes_moved"]) == set(docs["stage"]["bytes_moved"]) == layers
    for layer in layers:  # prompt + 2 decoded tokens written (the third is only sampled)
        n = docs["host"]["bytes_moved"][layer] // kv
        assert docs["host"]["bytes_moved"][layer] == n * kv and docs["stage"]["bytes_moved"][layer] == n * rows
