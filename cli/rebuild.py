"""``model-factory rebuild --check``: repeat a version's build from its provenance and compare the bytes."""

from __future__ import annotations

from pathlib import Path

import click

from model_factory.cli.common import progress_printer, user_errors


@click.command()
@click.argument("version_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--check", is_flag=True, required=True,
              help="Rebuild into a temporary folder and compare every output with the provenance (required).")
@click.option("--recipe", "recipe_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where the recipe file is now, when it moved since the build (its folder anchors the "
                   "recipe's relative paths; the recipe itself comes from the provenance).")
@click.option("--policy", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Trust policy TOML: verify the version (signature and provenance) before rebuilding it.")
@click.option("--keep", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Copy the rebuilt model folder here, to inspect a difference.")
@user_errors
def rebuild(version_dir: Path, check: bool, recipe_path: Path | None, policy: Path | None,
            keep: Path | None) -> None:
    """Rebuild REPO/MODEL/VERSION from its signed provenance and compare, file by file.

    Exits 1 on any difference, naming the file. TensorRT plans are listed as not compared
    (their builder times kernels). This checks that the signed files are what the recipe and
    inputs give, not who signed them: pass --policy to verify the version first.

    \b
    Example:
      model-factory rebuild --check --policy policy.toml model_repository/minilm/1
    """
    from model_factory.build.rebuild import rebuild_check

    report = rebuild_check(version_dir, recipe_path=recipe_path, progress=progress_printer(), keep=keep,
                           isolate=True, policy=policy)
    for line in report.input_changes:
        click.echo(f"INPUT CHANGED  {line}")
    for line in report.differences:
        click.echo(f"DIFFERENT      {line}")
    for line in report.not_compared:
        click.echo(f"NOT COMPARED   {line}")
    verdict = "reproduced" if report.ok else "NOT reproduced"
    click.echo(f"{report.model} version {report.version}: {verdict} ({len(report.identical)} files identical, "
               f"{len(report.differences)} different, {len(report.not_compared)} not compared)")
    if not report.ok:
        raise SystemExit(1)


COMMANDS = [rebuild]
