"""The placement decision as a pure function of measured numbers (no Ray)."""
import pytest

from engramflow.errors import EngramflowError
from engramflow.io.presets import preset
from engramflow.pipeline.placement_calibration import build_model, bytes_per_token
from engramflow.pipeline.projection_placement import (BackboneClock, LinkRate, PlacementModel, ProjectionPlacement,
                                                      ProjectionRate, check_projection_mode)

CFG = preset("deepseek-v4.1-flash")
KV, ROWS = bytes_per_token(CFG)
FLOP = 2 * CFG.engram_output_dim * CFG.engram_input_dim  # per position
WKV = CFG.engram_output_dim * CFG.engram_input_dim  # FP8 bytes
CPU = ProjectionRate.hardware(flops=400e9, bytes_per_s=30e9, weight_bytes=WKV, flop_per_token=FLOP)
GPU = ProjectionRate.hardware(flops=500e12, bytes_per_s=4e12, weight_bytes=WKV, flop_per_token=FLOP, overhead_s=2e-4)
SHM = LinkRate(latency_s=1e-3, bytes_per_s=5e9)  # one node: Ray's shared-memory object store
PCIE = LinkRate(latency_s=2e-4, bytes_per_s=50e9)


def test_released_shapes_move_a_sixteenth():
    assert (KV, ROWS) == (102_400, 6_336) and ROWS * 4 <= KV


def test_one_node_with_a_cpu_stage_projects_decode_on_the_host():
    model = PlacementModel(CPU, CPU, SHM, KV, ROWS)
    for lead in (0.0, 0.5e-3, 5e-3):
        assert model.choose(1, lead) == "host"


def test_one_node_sharing_its_cpu_sends_prefill_rows_and_projects_decode_on_the_host():
    """Same cores either way (the stage gets the host's rate): the bytes and the overlap decide."""
    model = PlacementModel(CPU, CPU, LinkRate(latency_s=2e-3, bytes_per_s=1e9), KV, ROWS)
    assert model.choose(1, lead_s=1e-3) == "host"
    assert model.choose(1, lead_s=0.0) == "host"
    assert model.choose(512, lead_s=1e-3) == "stage"  # 52 MB of K/V through the object store per layer


def test_a_gpu_stage_takes_large_prefill_chunks_as_rows():
    model = PlacementModel(CPU, GPU, PCIE, KV, ROWS)
    for t in (512, 2048, 8192):
        assert model.choose(t) == "stage"
        c = model.costs(t)
        assert (c.host_bytes, c.stage_bytes) == (t * KV, t * ROWS)
    # decode of a layer read late in the step: the host's GEMV hides behind the earlier blocks
    assert model.choose(1, lead_s=10e-3) == "host"


def test_one_gpu_box_with_a_socket_per_layer_keeps_decode_on_the_host_and_sends_prefill_rows():
    """The README's cluster: a socket's GEMV (150 MiB at 300 GB/s) against a Ray hop to an H200."""
    socket = ProjectionRate.hardware(flops=10e12, bytes_per_s=300e9, weight_bytes=WKV, flop_per_token=FLOP)
    model = PlacementModel(socket, GPU, LinkRate(latency_s=1e-3, bytes_per_s=50e9), KV, ROWS)
    for lead in (0.5e-3, 7e-3):  # layer 1 and layer 14 of a 20 ms decode step
        assert model.choose(1, lead) == "host"
    assert model.choose(8192, 0.5e-3) == "stage" and model.choose(8192, 7e-3) == "stage"


def test_the_decision_follows_the_rates():
    slow_host = ProjectionRate(decode_s=1.0, per_token_s=1.0)
    assert PlacementModel(CPU, CPU, LinkRate(0.0, 1e15), KV, ROWS).choose(512) == "host"  # a tie
    assert PlacementModel(slow_host, CPU, SHM, KV, ROWS).choose(512) == "stage"
    # a slow link makes the 16x larger K/V the expensive choice
    assert PlacementModel(CPU, CPU, LinkRate(0.0, 1e6), KV, ROWS).choose(512) == "stage"


def test_margin_keeps_ties_on_the_host():
    same = PlacementModel(CPU, CPU, LinkRate(0.0, 1e15), KV, ROWS, margin=0.1)
    assert same.choose(4096) == "host"
    a_bit_faster = ProjectionRate(CPU.decode_s, CPU.per_token_s * 0.95)
    assert PlacementModel(CPU, a_bit_faster, LinkRate(0.0, 1e15), KV, ROWS, margin=0.1).choose(4096) == "host"
    assert PlacementModel(CPU, a_bit_faster, LinkRate(0.0, 1e15), KV, ROWS, margin=0.0).choose(4096) == "stage"


def test_placement_learns_the_lead_from_steps():
    # host projection just slower than the stage's, unless it can hide behind the backbone
    host = ProjectionRate(decode_s=10e-3, per_token_s=1e-5)
    stage = ProjectionRate(decode_s=6e-3, per_token_s=1e-5)
    p = ProjectionPlacement("auto", PlacementModel(host, stage, LinkRate(0.0, 1e12), KV, ROWS), {1: 1 / 40, 14: 14 / 40})
    assert p.choose(14, 1) == "stage"  # nothing measured yet: no credit for overlap
    p.observe(1, 40e-3)  # a 40 ms decode step: block 14 is reached after 14 ms
    assert p.choose(14, 1) == "host" and p.choose(1, 1) == "stage"
    assert p.counts == {14: {"host": 1, "stage": 1}, 1: {"host": 0, "stage": 1}}


def test_fixed_modes_ignore_rates():
    assert ProjectionPlacement("stage").choose(1, 1) == "stage"
    assert ProjectionPlacement("host").choose(1, 10_000) == "host"


def test_backbone_clock():
    c = BackboneClock()
    assert c.seconds(7) == 0.0
    c.observe(1, 0.04)
    c.observe(512, 0.1)
    assert c.seconds(2) == 0.04 and c.seconds(400) == 0.1 and c.seconds(1024) == pytest.approx(0.2)


@pytest.mark.parametrize("bad", ["gpu", "", None, "Host", 1])
def test_bad_mode_names_the_value(bad):
    with pytest.raises(EngramflowError, match=f"projection must be one of host, stage, auto; got {bad!r}"):
        check_projection_mode(bad)
    with pytest.raises(EngramflowError, match="projection must be one of"):
        ProjectionPlacement(bad)


def test_auto_needs_rates_and_rates_are_checked():
    with pytest.raises(EngramflowError, match="needs measured rates"):
        ProjectionPlacement("auto")
    with pytest.raises(EngramflowError, match="per_token_s must be a finite number > 0, got 0"):
        ProjectionRate(1e-3, 0)
    with pytest.raises(EngramflowError, match="bytes_per_s must be"):
        LinkRate(1e-3, float("nan"))
    with pytest.raises(EngramflowError, match="incomplete or malformed"):
        build_model(CFG, {}, {"host": {"decode_s": 1, "per_token_s": 1}})
    measured = {"host": {"decode_s": 5e-3, "per_token_s": 1e-3}, "stage": {"decode_s": 5e-3, "per_token_s": 1e-3},
                "link": {"latency_s": 1e-3, "bytes_per_s": 1e9}}
    injected = build_model(CFG, measured, {"stage": {"decode_s": 1e-4, "per_token_s": 1e-6}})
    assert injected.stage.per_token_s == 1e-6 and injected.host.per_token_s == 1e-3
