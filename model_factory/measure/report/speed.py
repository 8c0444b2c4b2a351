"""Section "speed": throughput against p99 latency across concurrency, padding and groups per window.

Read from the JSON that ``model-factory bench --sweep ... --json`` writes
(:mod:`model_factory.measure.sweep`). The padding ratio and groups per window come
from the model-factory backend's own counters on the server's metrics port, scraped
around each point (``docs/metrics.md``).

A text-generation model's sweep (``task`` = ``text-generation``,
:mod:`model_factory.measure.generate_bench`) shows instead output tokens/s against time to
first token p99, and TTFT and inter-token latency (p50, p99) by concurrency.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

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
    generation: bool = False  # a text-generation model's streams: tokens/s, TTFT, ITL
    max_tokens: int | None = None  # output tokens per stream (generation)
    latency_plot: str | None = None  # TTFT and ITL by concurrency (generation)


def is_generation(points: Sequence[Mapping[str, Any]]) -> bool:
    """Whether these are a text-generation sweep's points (``sweep.GenerationPoint``)."""
    return bool(points) and "tokens_per_s" in points[0]


def collect(doc: Mapping[str, Any], source: Path) -> Speed:
    """The section for one sweep document (already read and checked by ``sweep.read_sweep``)."""
    points = tuple(doc["points"])
    generation = is_generation(points)
    return Speed(source=Path(source).name, model=str(doc.get("model")), protocol=str(doc.get("protocol")),
                 send=str(doc.get("send")), requests=sum(int(p.get("requests") or 0) for p in points) // len(points)
                 if generation else int(doc.get("requests") or 0), started=doc.get("started"),
                 machine=dict(doc.get("machine") or {}), points=points,
                 curve_plot=curve_plot(points) if points else None,
                 batching_plot=batching_plot(points) if any(p.get("padding_ratio") is not None or
                                                              p.get("groups_per_window") is not None
                                                              for p in points) else None,
                 generation=generation, max_tokens=doc.get("max_tokens") if generation else None,
                 latency_plot=latency_plot(points) if generation else None)


def curve_plot(points: tuple[Mapping[str, Any], ...], older: tuple[Mapping[str, Any], ...] = ()) -> str:
    """Throughput (x) against p99 latency (y), one marker per concurrency; an older release dashed.
    A text-generation sweep: output tokens/s (x) against time to first token p99 (y)."""
    if is_generation(points):
        return _curve(points, older if is_generation(older) else (), "tokens_per_s", "ttft_p99_ms",
                      "output tokens/s", "time to first token p99 (ms)",
                      "Output tokens/s against time to first token p99, by concurrency (c)")
    return _curve(points, older, "throughput", "p99_ms", "throughput (sequences/s)", "p99 latency (ms)",
                  "Throughput against p99 latency, by concurrency (c)")


def _curve(points: Sequence[Mapping[str, Any]], older: Sequence[Mapping[str, Any]], x: str, y: str, xlabel: str,
           ylabel: str, title: str) -> str:
    points = [p for p in points if p.get(x) is not None and p.get(y) is not None]
    older = [p for p in older if p.get(x) is not None and p.get(y) is not None]
    with plots.figure(8.0, 3.2) as (fig, ax):
        series = [("this release", points, plots.COLORS[0], "-")]
        if older:
            series.append(("older release", older, plots.QUIET_COLOR, "--"))
        for label, pts, color, style in series:
            xs = [p[x] for p in pts]
            ys = [p[y] for p in pts]
            ax.plot(xs, ys, style, marker="o", color=color, label=label)
            for p in pts:
                ax.annotate(f"c={p['concurrency']}", (p[x], p[y]), xytext=(5, -3),
                            textcoords="offset points", fontsize=7.5, color=color)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        ax.set_title(title)
        if older:
            ax.legend(frameon=False, fontsize=8)
        return plots.to_svg(fig, title.replace(", by", " by").replace(" (c)", "").lower())


def latency_plot(points: Sequence[Mapping[str, Any]]) -> str:
    """Time to first token and inter-token latency, p50 and p99, against concurrency (a generation sweep)."""
    with plots.figure(8.0, 2.4, ncols=2) as (fig, (left, right)):
        cs = [p["concurrency"] for p in points]
        for ax, key, title in ((left, "ttft", "Time to first token (ms)"), (right, "itl", "Inter-token latency (ms)")):
            for q, color in (("p50", plots.COLORS[0]), ("p99", plots.COLORS[3])):
                pairs = [(p["concurrency"], p[f"{key}_{q}_ms"]) for p in points if p.get(f"{key}_{q}_ms") is not None]
                if pairs:
                    ax.plot([c for c, _ in pairs], [v for _, v in pairs], marker="o", color=color, label=q)
            ax.set_xscale("log", base=2)
            ax.set_xticks(cs, [str(c) for c in cs])
            ax.minorticks_off()
            ax.set_xlabel("concurrency")
            ax.set_ylim(bottom=0)
            ax.set_title(title, fontsize=9)
            ax.legend(frameon=False, fontsize=8)
        return plots.to_svg(fig, "time to first token and inter-token latency by concurrency")


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
