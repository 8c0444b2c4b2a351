"""The ``wheelhouse`` command: wheels for an offline (``pip install --no-index``) install."""

from __future__ import annotations

from pathlib import Path

import click

from model_factory.cli.common import user_errors


@click.command()
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option("--extras", metavar="LIST",
              help="Comma-separated extras to include, e.g. serve,sign,gpu (repeatable).", multiple=True)
@click.option("--python-version", default=None, metavar="3.X",
              help="Target Python (e.g. 3.12 for the 25.xx NGC images). Default: this Python.")
@click.option("--platform", default=None, metavar="TAG",
              help="Target wheel platform, e.g. manylinux_2_39_x86_64 (older manylinux levels are "
                   "accepted too). Default: this machine.")
@click.option("--with", "packages", multiple=True, metavar="SPEC",
              help="A further requirement to include, e.g. tensorrt-cu13==10.13.3.9 (repeatable).")
@click.option("--constraint", "-c", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="pip constraints file, e.g. pinning torch==2.13.0+cpu.")
@click.option("--pip-arg", "pip_args", multiple=True, metavar="ARG",
              help="Passed to pip as is, e.g. --pip-arg=--extra-index-url=https://download.pytorch.org/whl/cpu")
@click.option("--project-dir", default=".", show_default=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The model-factory source checkout to build the wheel from.")
@click.option("--force", is_flag=True, help="Replace DEST if it is an existing wheelhouse.")
@click.option("--check", is_flag=True, help="Check the wheelhouse DEST against its manifest instead of building.")
@click.option("--quiet", "-q", is_flag=True, help="Hide pip's progress.")
@user_errors
def wheelhouse(dest: Path, extras: tuple[str, ...], python_version: str | None, platform: str | None,
               packages: tuple[str, ...], constraint: Path | None, pip_args: tuple[str, ...], project_dir: Path,
               force: bool, check: bool, quiet: bool) -> None:
    """Build a wheelhouse in DEST: model-factory and all its dependencies as wheels,
    with requirements.txt, SHA256SUMS and manifest.json, for an install with no index.

    Run it on a connected machine; carry DEST in; install with --no-index.

    \b
    Examples:
      # for the images of docker-compose.yml (NGC 25.10: Python 3.12, glibc 2.39)
      model-factory wheelhouse wheelhouse --extras export,onnx,sign,serve,gpu \\
          --python-version 3.12 --platform manylinux_2_39_x86_64
      # after carrying it in:
      model-factory wheelhouse wheelhouse --check
      pip install --no-index --find-links wheelhouse 'model-factory[serve,sign]'
    """
    from model_factory.distribution.wheelhouse import build_wheelhouse, check_wheelhouse

    if check:
        report = check_wheelhouse(dest)
        click.echo(f"{dest}: {len(report.wheels)} wheels match the manifest "
                   f"(model-factory {report.project_version}, extras: {','.join(report.extras) or 'none'})")
        return
    report = build_wheelhouse(dest, extras, python_version, platform, project_dir, packages=packages,
                              constraints=constraint, pip_args=pip_args, overwrite=force, echo=not quiet)
    target = f"Python {report.python_version or 'of this machine'}, " + \
             (f"platform {report.platforms[0]}" if report.platforms else "this platform")
    click.echo(f"wrote {report.path}: {len(report.wheels)} wheels, {report.total_bytes / 2**20:.1f} MiB ({target})")
    click.echo(f"install with: {report.install_command()}")


COMMANDS = [wheelhouse]
