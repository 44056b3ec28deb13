"""A bar's length means something: the figures of ratios near 1 (memory held beyond the peak, in %) draw bars on a
linear axis from 0, so a bar's length is the value its label gives; on a log axis it was set by an arbitrary floor
(0.01%). The correctness figure, whose ratios span ten decades, draws points on its log axis instead of bars."""
import pytest

from xlab import paths, plots


@pytest.mark.parametrize("name", ["memory_schemes", "dynamic_shapes", "dynamic_scale"])
def test_memory_held_is_drawn_on_a_linear_axis_from_zero(name):
    fig = plots.draw(name, paths.data_dir())
    held = [ax for ax in fig.axes if "peak requested" in ax.get_ylabel() and ax.patches]
    assert held
    for ax in held:
        assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0
        bars = [p for p in ax.patches if p.get_height() > 0]
        assert bars and all(p.get_y() == 0 for p in bars)                  # each bar starts at 0


def test_correctness_draws_no_bar_on_its_log_axis():
    fig = plots.draw("correctness", paths.data_dir())
    for ax in fig.axes:
        assert ax.get_xscale() == "log" and not ax.patches and ax.collections
