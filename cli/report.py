"""``model-factory report``: one self-contained HTML page per release."""

from __future__ import annotations

from pathlib import Path

import click

from model_factory.cli.common import user_errors

_file = click.Path(dir_okay=False, exists=True, path_type=Path)
_dir = click.Path(file_okay=False, exists=True, path_type=Path)


@click.command("report")
@click.argument("repository", type=_dir)
@click.option("--model", "-m", default=None, help="Report on this model only (default: every model).")
@click.option("--bench", type=_file, default=None,
              help="Sweep JSON from model-factory bench --sweep ... --json (the speed section).")
@click.option("--against", type=_dir, default=None,
              help="An older release's model repository: add what changed since its latest version.")
@click.option("--against-bench", type=_file, default=None, help="The older release's sweep JSON (compare speed).")
@click.option("--policy", type=_file, default=None, help="Trust policy TOML: verify each version with it.")
@click.option("--accept", is_flag=True, help="Run acceptance on this machine (replay the golden inputs).")
@click.option("--acceptance", type=_file, default=None, help="Acceptance results from model-factory accept --json.")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The HTML file to write.")
@user_errors
def report(repository: Path, model: str | None, bench: Path | None, against: Path | None,
           against_bench: Path | None, policy: Path | None, accept: bool, acceptance: Path | None,
           output: Path) -> None:
    """Write one self-contained HTML page about each model version of REPOSITORY.

    What was built, accuracy per precision against the gate (and INT8's float layers),
    engines, trust (signature, provenance, policy verdict, acceptance), speed and, with
    --against, what changed since an older release. No script and nothing fetched: it
    opens offline.

    \b
    Example:
      model-factory bench -m minilm --texts benchmarks/texts.txt --sweep 1,8,32,64 \\
          --json sweep.json --metrics-url http://localhost:8002/metrics
      model-factory report model_repository --bench sweep.json --policy policy.toml \\
          --against /releases/previous/model_repository -o report.html
    """
    from model_factory.measure.report import ReportInputs, write_report

    out = write_report(ReportInputs(repository, model, bench, against, against_bench, policy, accept, acceptance),
                       output)
    click.echo(f"wrote {out}")


COMMANDS = [report]
