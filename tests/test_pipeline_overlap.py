"""The K/V refs travel nested: a stage runs its early blocks and waits only at the Engram layer."""
import pytest

from engramflow.pipeline.pipeline import Pipeline

BLOCK_MS = 10.0
L14_DELAY_MS = 400.0


@pytest.mark.timing
@pytest.mark.parametrize("stages", [1, 2])
def test_l14_wait_is_taken_at_l14_not_at_stage_entry(ray_session, tiny_ckpt, stages):
    pipe = Pipeline.launch(tiny_ckpt, stages=stages, backbone="emulated", block_ms=BLOCK_MS,
                           projection_delay_ms={14: L14_DELAY_MS})
    try:
        s = pipe.open()
        pipe.drain_spans()
        pipe.prefill(s, [10, 20, 30, 40])
        spans = pipe.drain_spans()
    finally:
        pipe.shutdown()
    blocks = {int(x["name"].split()[1]): x for x in spans if x["name"].startswith("block ")}
    waits = {x["args"]["layer"]: x for x in spans if x["name"].startswith("wait L")}
    (proj14,) = [x for x in spans if x["name"] == "project L14"]
    assert sorted(blocks) == list(range(16))
    # blocks 0..13 ran before the L14 projection finished: nothing waited on it at stage entry
    assert blocks[13]["end_ns"] < proj14["end_ns"]
    assert blocks[8]["start_ns"] < proj14["end_ns"]  # also the second stage's first block
    # the wait sits at block 14's entry and lasts until the projection is done
    w = waits[14]
    assert w["start_ns"] >= blocks[13]["end_ns"]
    assert w["end_ns"] >= proj14["end_ns"] - 5e6  # clocks of two processes, 5 ms slack
    expected_ms = (proj14["end_ns"] - blocks[14]["start_ns"]) / 1e6
    assert (w["end_ns"] - w["start_ns"]) / 1e6 == pytest.approx(expected_ms, abs=25)
