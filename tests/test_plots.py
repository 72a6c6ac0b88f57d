"""The timing model's pictures read at a glance: every series its own style and legend entry,
labelled axes and colour bar, symbols defined, a far-off reference marked without squashing
the model's lines; and the commands say where they wrote them. Inspects the matplotlib figures."""
import math

import numpy as np

from cli_run import engramflow
from engramflow.cli.plots import heatmap_figure, ttft_figure
from engramflow.cli.timing import CLUSTER
from engramflow.profiling.prefill_model import PrefillFigures, predict_prefill
from engramflow.profiling.timing_model import PATHS_MS, predict


def ttft_rows():
    fig = PrefillFigures(**CLUSTER)
    lengths = [512, 2048, 8192, 32768, 51200]
    return predict_prefill(fig, lengths, pipelined=False) + predict_prefill(fig, lengths, pipelined=True)


def test_ttft_lines_are_distinct_and_each_in_the_legend():
    fig = ttft_figure(ttft_rows(), reference=(51200, 26.0, "zLLM"))
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert len(lines) == 4
    looks = {(l.get_linestyle(), l.get_marker()) for l in lines}
    assert len(looks) == 4  # told apart without colour too
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert set(legend) == {l.get_label() for l in lines} | {"zLLM (reference)"}
    assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
    assert any("zLLM" in t.get_text() for t in ax.texts)  # the reference is annotated


def test_the_reference_point_does_not_squash_the_model():
    fig = ttft_figure(ttft_rows(), reference=(51200, 26.0, "zLLM"))
    (ax,) = fig.axes
    lo, hi = ax.get_ylim()
    ys = np.concatenate([l.get_ydata() for l in ax.get_lines()])
    span = (math.log(ys.max()) - math.log(ys.min())) / (math.log(hi) - math.log(lo))
    assert ax.get_yscale() == "log" and span > 0.6, span  # the lines fill most of the height


def test_heatmap_scale_labels_and_symbols():
    rows = [predict(s, f, f, path=p) for p, f in PATHS_MS.items() for s in (25, 100, 600)]
    fig = heatmap_figure(rows)
    ax, bar = fig.axes
    assert ax.get_xlabel() and ax.get_ylabel() and bar.get_ylabel()
    assert "T" in ax.get_title() and "W:" in ax.get_title() and "T:" in ax.get_title()  # symbols defined
    (image,) = ax.get_images()
    assert type(image.norm).__name__ == "LogNorm"
    colours = image.cmap(image.norm(image.get_array()))  # RGBA per cell
    others = [i for i, p in enumerate(PATHS_MS) if p != "spinning-disk"]
    # the slowest row no longer sets one pale colour for all others: their cells differ
    assert len({tuple(np.round(c, 3)) for row in colours[others] for c in row}) >= len(others) + 2
    assert [t.get_text() for t in ax.get_yticklabels()] == list(PATHS_MS)


def test_timing_model_says_where_it_wrote(tmp_path):
    heat, plot = tmp_path / "a" / "heat.png", tmp_path / "ttft.png"
    done = engramflow("timing-model", "--heatmap", heat, "--json")
    assert done.returncode == 0 and f"wrote {heat}" in done.stderr and heat.stat().st_size > 0
    assert done.stdout.startswith("{")  # stdout stays JSON
    done = engramflow("timing-model", "--prefill", "--plot", plot)
    assert done.returncode == 0 and f"wrote {plot}" in done.stderr and plot.stat().st_size > 0
