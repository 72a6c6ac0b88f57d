"""The timing model's pictures read at a glance: every series its own style and legend entry,
labelled axes and colour bar, symbols defined, a far-off reference marked without squashing
the model's lines; and the commands say where they wrote them. Inspects the matplotlib figures."""
import math

import numpy as np

from cli_run import engramflow_here as engramflow
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


def test_access_coverage_curves_read_at_a_glance(v41_layout):
    """access-stats' coverage.png: a panel per Engram layer, a curve per n-gram size plus all
    columns, each its own line style and legend entry (with its row count), rising to 1."""
    from engramflow.data.access.counts import ngram_row_ranges
    from engramflow.data.access.report import coverage_figure

    rng = np.random.default_rng(0)
    merged = []
    for layer in range(len(v41_layout.layer_ids)):
        ranges = ngram_row_ranges(v41_layout, layer)
        rows = np.sort(np.concatenate([rng.choice(np.arange(lo, hi), 300, replace=False) for lo, hi in ranges.values()]))
        merged.append((rows, rng.zipf(1.5, rows.size).astype(np.int64)))
    fig = coverage_figure(v41_layout, merged)
    assert len(fig.axes) == len(v41_layout.layer_ids)
    for ax, layer_id, (rows, _) in zip(fig.axes, v41_layout.layer_ids, merged):
        lines = ax.get_lines()
        assert len(lines) == v41_layout.max_ngram - 1 + 1  # n = 2..max, and all columns
        assert len({str(l.get_linestyle()) for l in lines}) == len(lines)
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == [l.get_label() for l in lines] and f"all columns ({rows.size:,} rows)" in labels
        for line in lines:
            y = line.get_ydata()
            assert np.all(np.diff(y) >= 0) and y[-1] == 1.0 and y[0] > 0
        assert ax.get_xscale() == "log" and ax.get_xlabel() and ax.get_ylabel() and str(layer_id) in ax.get_title()
