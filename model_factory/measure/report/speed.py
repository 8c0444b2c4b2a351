"""Section "speed": throughput against p99 latency across concurrency, padding and groups per window.

Read from the JSON that ``model-factory bench --sweep ... --json`` writes
(:mod:`model_factory.measure.sweep`). The padding ratio and groups per window come
from the model-factory backend's own counters on the server's metrics port, scraped
around each point (``docs/metrics.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from model_factory.measure.report import plots


@dataclass(frozen=True)
class Speed:
    source: str
    model: str
    protocol: str
    send: str
    requests: int
    started: str | None
    machine: Mapping[str, Any]
    points: tuple[Mapping[str, Any], ...]
    curve_plot: str | None
    batching_plot: str | None


def collect(doc: Mapping[str, Any], source: Path) -> Speed:
    """The section for one sweep document (already read and checked by ``sweep.read_sweep``)."""
    points = tuple(doc["points"])
    return Speed(source=Path(source).name, model=str(doc.get("model")), protocol=str(doc.get("protocol")),
                 send=str(doc.get("send")), requests=int(doc.get("requests") or 0), started=doc.get("started"),
                 machine=dict(doc.get("machine") or {}), points=points,
                 curve_plot=curve_plot(points) if points else None,
                 batching_plot=batching_plot(points) if any(p.get("padding_ratio") is not None or
                                                              p.get("groups_per_window") is not None
                                                              for p in points) else None)


def curve_plot(points: tuple[Mapping[str, Any], ...], older: tuple[Mapping[str, Any], ...] = ()) -> str:
    """Throughput (x) against p99 latency (y), one marker per concurrency; an older release dashed."""
    with plots.figure(8.0, 3.2) as (fig, ax):
        series = [("this release", points, plots.COLORS[0], "-")]
        if older:
            series.append(("older release", older, plots.QUIET_COLOR, "--"))
        for label, pts, color, style in series:
            xs = [p["throughput"] for p in pts]
            ys = [p["p99_ms"] for p in pts]
            ax.plot(xs, ys, style, marker="o", color=color, label=label)
            for p in pts:
                ax.annotate(f"c={p['concurrency']}", (p["throughput"], p["p99_ms"]), xytext=(5, -3),
                            textcoords="offset points", fontsize=7.5, color=color)
        ax.set_xlabel("throughput (sequences/s)")
        ax.set_ylabel("p99 latency (ms)")
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        ax.set_title("Throughput against p99 latency, by concurrency (c)")
        if older:
            ax.legend(frameon=False, fontsize=8)
        return plots.to_svg(fig, "throughput against p99 latency by concurrency")


def batching_plot(points: tuple[Mapping[str, Any], ...]) -> str:
    """Padding ratio and groups per window against concurrency (the server's counters)."""
    with plots.figure(8.0, 2.4, ncols=2) as (fig, (left, right)):
        cs = [p["concurrency"] for p in points]
        for ax, key, title, color in ((left, "padding_ratio", "Padding ratio (computed / real tokens)",
                                       plots.COLORS[1]),
                                      (right, "groups_per_window", "Engine launches per window", plots.COLORS[2])):
            pairs = [(c, p[key]) for c, p in zip(cs, points) if p.get(key) is not None]
            if pairs:
                ax.plot([c for c, _ in pairs], [v for _, v in pairs], marker="o", color=color)
            ax.set_xscale("log", base=2)
            ax.set_xticks(cs, [str(c) for c in cs])
            ax.minorticks_off()
            ax.set_xlabel("concurrency")
            ax.set_title(title, fontsize=9)
            low = 0.0 if key == "groups_per_window" else 1.0
            ax.set_ylim(low, max([v for _, v in pairs] + [low + 0.1]) * 1.1)
        return plots.to_svg(fig, "padding ratio and groups per window by concurrency")
