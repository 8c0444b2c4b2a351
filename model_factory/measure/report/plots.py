"""Matplotlib (Agg) figures rendered to inline SVG: the report's plots.

Text stays text in the SVG (``svg.fonttype = none``), so numbers on a plot can be
selected and searched, and the page's own font draws them. Output is made
deterministic (fixed hash salt, no date) so two reports of one build are byte-equal.
"""

from __future__ import annotations

import io
import re
from contextlib import contextmanager
from typing import Any, Iterator

from model_factory.errors import require

# A muted, colour-blind safe palette (Okabe-Ito).
COLORS = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
GATE_COLOR = "#D55E00"
KEPT_COLOR = "#D55E00"
QUIET_COLOR = "#8a8f98"

_RC = {
    "svg.fonttype": "none",
    "svg.hashsalt": "model-factory-report",
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e3e6ea",
    "grid.linewidth": 0.6,
    "axes.edgecolor": "#9aa0a6",
    "axes.titlesize": 10,
    "axes.titleweight": "bold",
    "axes.titlelocation": "left",
}


def _pyplot() -> Any:
    matplotlib = require("matplotlib", "report")
    matplotlib.use("Agg", force=True)  # no display, no GUI toolkit: the report renders anywhere
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def figure(width_in: float = 8.0, height_in: float = 3.0, ncols: int = 1) -> Iterator[tuple[Any, Any]]:
    """A figure and its axes with the report's style; closed when the block ends."""
    plt = _pyplot()
    with plt.rc_context(_RC):
        fig, axes = plt.subplots(1, ncols, figsize=(width_in, height_in), layout="constrained")
        try:
            yield fig, axes
        finally:
            plt.close(fig)


_PROLOGUE = re.compile(r"^.*?(?=<svg)", re.S)


def to_svg(fig: Any, label: str) -> str:
    """The figure as an ``<svg>`` element for inlining (XML prologue dropped), with an accessible label."""
    plt = _pyplot()
    buf = io.StringIO()
    with plt.rc_context(_RC):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    svg = _PROLOGUE.sub("", buf.getvalue(), count=1)
    # The natural size is kept (the page's CSS shrinks it to fit a narrow window, never enlarges it).
    safe_label = label.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")
    return svg.replace("<svg", f'<svg role="img" aria-label="{safe_label}" class="plot"', 1)
