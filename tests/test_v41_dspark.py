"""The DSpark draft layers against numbers the official DeepSeek V4.1 code produced
(tests/data/v41_small/dspark_golden.*): after a 5-token prefill, 40 teacher-forced decode
steps (past the 16-slot window, so the draft layers' ring wraps), each step's drafted tokens,
draft logits (Markov biases added) and confidence, bit-equal.
"""
import json

import pytest
import torch

from engramflow.errors import EngramflowError
from engramflow.model.v41.config import v41_from_dict
from engramflow.model.v41.dspark import ring_positions
from engramflow.model.v41.dspark_config import dspark_config
from engramflow.pipeline.engine import Engine
from engramflow.pipeline.pipeline import Pipeline
from engramflow.pipeline.speculative import parse_speculative
from v41_golden import V41_SMALL, dspark_golden, engine_fixture, golden, rel_diff

pytestmark = pytest.mark.default_threads  # golden bits: torch's default thread count (conftest.py)

# between CPU kinds the draft logits drift apart as the caches fill (measured: equal for 12
# steps, then up to 0.29 of the logit range by step 40, Zen 5 against the first set)
CROSS_CPU_TOLERANCE = 0.35
engine = engine_fixture(speculative="dspark", numerics="official")  # the golden bits are the official code's
batched_engine = engine_fixture(speculative="dspark")  # the default numerics


def test_drafts_logits_and_confidence_equal_the_official_code(engine):
    gold, exact = dspark_golden()
    meta = json.loads((V41_SMALL / "dspark_golden.json").read_text())
    ids, p = golden()["ids_a"].tolist(), meta["prefill_tokens"]
    s = engine.open()
    engine.prefill(s, ids[:p])
    for i, t in enumerate(range(p, p + meta["decode_steps"])):
        logits = engine.decode_step({s: ids[t]})[s]
        draft = engine.stage.draft(s, ids[t + 1])
        if exact:
            assert torch.equal(logits, gold["backbone_logits"][i]), f"backbone at {t}"
            assert draft.tokens == gold["drafts"][i, 1:].tolist(), f"drafts at {t}"
            assert torch.equal(draft.logits, gold["draft_logits"][i]), f"draft logits at {t}"
            assert torch.equal(draft.confidence, gold["confidence"][i]), f"confidence at {t}"
        else:  # other CPU kernels: close, not bit-equal
            assert rel_diff(draft.logits, gold["draft_logits"][i]) < CROSS_CPU_TOLERANCE, f"draft logits at {t}"
    engine.close(s)


def test_drafts_of_many_sessions_in_one_forward_equal_each_alone(batched_engine):
    """The scheduler drafts every drafting session of a step in one forward of the draft layers
    (Runner.drafts): each session's tokens, logits and confidence are bit-equal to its draft
    alone, greedy and sampled, whatever the others' lengths."""
    from engramflow.model.sampling import Sampling

    e, ids = batched_engine, golden()["ids_a"].tolist()
    sessions = []
    for k, length in enumerate((5, 9, 23, 40)):  # rings at different fill levels (window 16)
        s = e.open()
        e.prefill(s, ids[k:k + length])
        sessions.append(s)
    sampled = Sampling(temperature=0.9, top_k=40, seed=3)
    block = e.stage.dcfg.block_size
    asks = [(s, ids[50 + i], e.length(s), max(1, block - i % 2), sampled if i % 2 else Sampling(), i, 7)
            for i, s in enumerate(sessions)]
    together = e.drafts(asks)
    for ask, got in zip(asks, together):
        (alone,) = e.drafts([ask])
        assert got.tokens == alone.tokens and len(got.tokens) == ask[3]
        assert torch.equal(got.logits, alone.logits) and torch.equal(got.confidence, alone.confidence)
    for s in sessions:
        e.close(s)


def test_ring_slots_hold_the_latest_position_of_their_residue():
    assert ring_positions(5, 16).tolist() == [0, 1, 2, 3, 4]
    got = ring_positions(20, 16).tolist()  # positions 16..19 overwrote slots 0..3
    assert got == [16, 17, 18, 19] + list(range(4, 16))
    for end in range(1, 70):
        pos = ring_positions(end, 16)
        assert sorted(pos.tolist()) == list(range(max(0, end - 16), end))
        assert all(int(p) % 16 == s for s, p in enumerate(pos))


def test_speculative_option_is_checked():
    assert parse_speculative(None) is None and parse_speculative("dspark") == (0, False, None)
    assert parse_speculative("dspark:3") == (3, False, None) and parse_speculative("dspark:exact") == (0, True, None)
    assert parse_speculative("dspark:2:exact:adaptive") == (2, True, 0.5)
    assert parse_speculative("dspark:adaptive=0.8").threshold == 0.8
    for bad in ("eagle", "dspark:0", "dspark:x", "dspark:-1", "dspark:2:3", "exact", 5, "dspark:exact:2",
                "dspark:adaptive=1", "dspark:adaptive=x", "dspark:adaptive=0", "dspark:exact:exact", "dspark:adaptiv"):
        with pytest.raises(EngramflowError, match="speculative"):
            parse_speculative(bad)
    with pytest.raises(EngramflowError, match="block of 2"):
        Engine(V41_SMALL, speculative="dspark:3")
    # the pipeline checks the draft count and the backbone on the driver, before Ray starts
    for backbone, spec, message in (("v41", "dspark:3", "block of 2"), ("emulated", "dspark", "needs the v41 backbone")):
        with pytest.raises(EngramflowError, match=message):
            Pipeline.launch(V41_SMALL, backbone=backbone, speculative=spec)


def test_draft_layer_config_errors_name_the_key():
    raw = json.loads((V41_SMALL / "config.json").read_text())
    cfg = v41_from_dict(raw)
    assert dspark_config(raw, cfg).block_size == 2
    for key, value in (("dspark_target_layer_ids", [9]), ("dspark_target_layer_ids", [5, 4]),
                       ("dspark_noise_token_id", 512), ("dspark_n_activated_experts", 9),
                       ("dspark_block_size", "2")):
        with pytest.raises(EngramflowError, match=key):
            dspark_config(raw | {key: value}, cfg)
    with pytest.raises(EngramflowError, match="no DSpark"):
        dspark_config(raw | {"dspark_block_size": 0}, cfg)
