"""The prefill timing model (TTFT by placement) and `timing-model --prefill`."""
import json

import pytest

from engramflow.cli.app import main
from engramflow.errors import EngramflowError
from engramflow.profiling.prefill_model import PrefillFigures, chunk_ms, ttft_ms

# round numbers: 1 GFLOP per token, 1 MB of weights, K/V 1000 B and rows 100 B per token
SIMPLE = dict(host_gflops=1.0, host_gbps=1.0, device_tflops=1.0, link_gbps=1.0, link_latency_ms=0.0,
              device_gbps=1000.0, gather_us_per_token=0.0, chunk=100, n_layers=40, engram_layers=(1, 14),
              kv_bytes_per_token=1000, rows_bytes_per_token=100, flop_per_token=1e9, wkv_bytes=1e6)


def test_hand_computed_chunk():
    fig = PrefillFigures(**SIMPLE, backbone_ms_per_chunk=400.0, host_share=1)
    # host: 100 tokens x 1 GFLOP at 1 GFLOP/s = 100 s per layer, + 0.1 ms of K/V; L1 reached at 10 ms
    step, busy = chunk_ms(fig, 100, "host")
    assert busy == pytest.approx(100_000.0)
    assert step == pytest.approx(400 + (100_000 + 0.1 - 10))  # L14 is ready by the time L1's stall ends
    # stage: each layer costs the device's 100 GFLOP at 1 TFLOP/s on the critical path (rows: 0.01 ms)
    step, _ = chunk_ms(fig, 100, "stage")
    assert step == pytest.approx(400 + 100 + 100)


def test_host_projection_hides_behind_the_backbone_when_it_can():
    fig = PrefillFigures(**(SIMPLE | {"host_gflops": 1e6}), backbone_ms_per_chunk=400.0, host_share=1)
    step, _ = chunk_ms(fig, 100, "host")  # 0.1 ms projection + 0.1 ms link, L1 at 10 ms: hidden
    assert step == pytest.approx(400.0)
    assert ttft_ms(fig, 250, "host") == pytest.approx(3 * 400.0)  # chunks of 100, 100, 50


def test_serial_vs_pipelined():
    fig = PrefillFigures(**(SIMPLE | {"host_gflops": 1e6}), backbone_ms_per_token=1.0, stages=4, host_share=1)
    serial = ttft_ms(fig, 1000, "stage")
    piped = ttft_ms(fig, 1000, "stage", pipelined=True)
    assert piped < serial
    assert piped == pytest.approx(chunk_ms(fig, 100, "stage")[0] + 9 * chunk_ms(fig, 100, "stage")[0] / 4)


def test_the_released_shapes_favour_rows_on_a_gpu_and_long_prompts():
    fig = PrefillFigures(host_gflops=400, host_gbps=30, device_tflops=500, link_gbps=25, link_latency_ms=1,
                         backbone_ms_per_token=0.07)
    for p in (2048, 51200):
        assert ttft_ms(fig, p, "stage") < ttft_ms(fig, p, "host")


@pytest.mark.parametrize("kw,match", [({"host_gflops": 0}, "host_gflops must be > 0"),
                                      ({"stages": 1.5}, "stages must be an integer"),
                                      ({"link_gbps": float("nan")}, "link_gbps must be a finite number"),
                                      ({"engram_layers": (50,)}, "engram_layers must lie in")])
def test_bad_figures(kw, match):
    with pytest.raises(EngramflowError, match=match):
        PrefillFigures(**(SIMPLE | kw))
    fig = PrefillFigures(**SIMPLE)
    with pytest.raises(EngramflowError, match="placement must be one of host, stage; got 'gpu'"):
        ttft_ms(fig, 10, "gpu")


def test_cli_prefill_json_and_plot(tmp_path, capsys):
    png = tmp_path / "ttft.png"
    assert main(["timing-model", "--prefill", "--prompt-lengths", "512,51200", "--json", "--plot", str(png)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["figures"]["stages"] == 8
    assert {(r["prompt_tokens"], r["placement"], r["pipelined"]) for r in doc["rows"]} == {
        (p, pl, f) for p in (512, 51200) for pl in ("host", "stage") for f in (False, True)}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["timing-model", "--prefill", "--host-gflops", "0"]) == 2
    assert "host_gflops must be > 0" in capsys.readouterr().err


def test_cli_generate_refuses_a_bad_projection(capsys):
    assert main(["generate", "--checkpoint", "x", "--prompt", "hi", "--projection", "gpu"]) == 2
    assert "invalid choice: 'gpu'" in capsys.readouterr().err
