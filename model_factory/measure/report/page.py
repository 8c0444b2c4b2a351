"""The page: collect every section for each model version and render the Jinja2 templates.

The HTML is one self-contained file: the stylesheet is inlined, the plots are inline
SVG, there is no script, font, image or link that the browser would fetch. Numbers
shown on the page carry a ``data-k`` attribute naming what they are, so a reader (or a
test in a browser) can find each one.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from model_factory import __version__
from model_factory.errors import FactoryError, require
from model_factory.measure.report import accuracy, built, changes, engines, speed, trust
from model_factory.measure.report import inputs as inputs_section
from model_factory.measure.report.release import Release, find_releases, latest_release


@dataclass(frozen=True)
class VersionReport:
    """Every section of one model version."""

    release: Release
    built: built.Built
    inputs: inputs_section.Inputs
    accuracy: accuracy.Accuracy
    engines: engines.Engines
    trust: trust.Trust
    speed: speed.Speed | None
    changes: changes.Changes | None

    @property
    def anchor(self) -> str:
        return f"{self.release.model}-v{self.release.version}"


@dataclass(frozen=True)
class ReportInputs:
    """What ``model-factory report`` was asked to put on the page."""

    repo: Path
    model: str | None = None
    bench: Path | None = None
    against: Path | None = None
    against_bench: Path | None = None
    policy: Path | None = None
    accept: bool = False
    acceptance: Path | None = None


def _mib(value: Any) -> str:
    return "–" if value is None else f"{value / 2**20:,.1f} MiB"


def _num(value: Any, fmt: str = "{:.6f}") -> str:
    if value is None:
        return "–"
    if isinstance(value, float) and value != value:
        return "nan"
    return fmt.format(value)


def _signed(value: Any, fmt: str = "{:+.6f}") -> str:
    return "–" if value is None else fmt.format(value)


def _short(digest: Any, n: int = 12) -> str:
    return "–" if not digest else str(digest)[:n] + "…"


def environment() -> Any:
    """The Jinja2 environment over the packaged templates (autoescaped HTML)."""
    jinja2 = require("jinja2", "report")
    env = jinja2.Environment(loader=jinja2.PackageLoader("model_factory.measure.report", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"], default=True),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(mib=_mib, num=_num, signed=_signed, short=_short,
                       bytes=lambda v: "–" if v is None else f"{v:,}")
    env.globals["Markup"] = jinja2.utils.markupsafe.Markup
    return env


def _sweep(path: Path | None) -> Mapping[str, Any] | None:
    from model_factory.measure.sweep import read_sweep

    return None if path is None else read_sweep(path)


def collect(inputs: ReportInputs) -> list[VersionReport]:
    """Every section of every selected model version, read from the repositories and files given."""
    repo = Path(inputs.repo)
    releases = find_releases(repo, inputs.model)
    bench, old_bench = _sweep(inputs.bench), _sweep(inputs.against_bench)
    if inputs.against is not None and not Path(inputs.against).is_dir():
        raise FactoryError(f"--against {inputs.against} is not a folder. Fix: pass the older release's model "
                           "repository")
    records: list[dict[str, Any]] | None = None
    source = ""
    if inputs.acceptance is not None:
        records, source = trust.read_acceptance(inputs.acceptance), Path(inputs.acceptance).name
    elif inputs.accept:
        records = trust.run_acceptance(repo, sorted({r.model for r in releases}))
        source = "run on this machine while writing the report"
    latest = {r.model: max(x.version for x in releases if x.model == r.model) for r in releases}
    out = []
    for rel in releases:
        b, a, e = built.collect(rel), accuracy.collect(rel), engines.collect(rel)
        t = trust.collect(rel, inputs.policy, records, source)
        # The sweep measured what the server served: the model's highest version.
        s = (speed.collect(bench, Path(inputs.bench)) if bench is not None and bench.get("model") == rel.model
             and rel.version == latest[rel.model] else None)
        ch = None
        old = latest_release(Path(inputs.against), rel.model) if inputs.against is not None else None
        if old is not None:
            old_points = old_bench["points"] if old_bench is not None and old_bench.get("model") == rel.model else ()
            ch = changes.compare(rel, old, new_built=b, old_built=built.collect(old), new_acc=a,
                                 old_acc=accuracy.collect(old), new_trust=t,
                                 old_trust=trust.collect(old, inputs.policy), new_points=s.points if s else (),
                                 old_points=old_points)
            if ch.speed and s is not None:
                s = dataclasses.replace(s, curve_plot=speed.curve_plot(s.points, tuple(old_points)))
        out.append(VersionReport(rel, b, inputs_section.collect(rel, bench if s is not None else None), a, e, t, s, ch))
    return out


def render(inputs: ReportInputs, versions: Sequence[VersionReport] | None = None) -> str:
    """The report as one HTML document."""
    versions = list(versions) if versions is not None else collect(inputs)
    env = environment()
    css = (Path(__file__).parent / "templates" / "style.css").read_text(encoding="utf-8")
    return env.get_template("report.html.j2").render(
        versions=versions, inputs=inputs, css=css, tool_version=__version__,
        generated=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))


def write_report(inputs: ReportInputs, out: Path) -> Path:
    """Render the report and write it to ``out`` atomically; returns ``out``."""
    from model_factory.fileio import atomic_file

    html = render(inputs)
    with atomic_file(Path(out)) as f:
        f.write(html)
    return Path(out)
