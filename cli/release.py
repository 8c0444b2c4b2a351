"""``model-factory release ...``: publish signed releases (TUF) of a model repository.

Each command parses its options, calls one function of :mod:`model_factory.signing.release` and
prints. The runbook (keys, ceremony, rotation, the timestamp schedule) is docs/releases.md.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict
from pathlib import Path

import click

from model_factory.cli.common import user_errors
from model_factory.cli.signing import _ask_password_option, _password, _password_file_option

_KEY = click.Path(exists=True, dir_okay=False, path_type=Path)
_REPO = click.argument("repository", type=click.Path(exists=True, file_okay=False, path_type=Path))


def _keys(paths: tuple[Path, ...], password: bytes | None) -> list:
    from model_factory.signing.release import KeyFile

    return [KeyFile(p, password) for p in paths]


@click.group()
def release() -> None:
    """Signed releases of a repository: a fleet refuses rollback, freeze and mix-and-match.

    \b
    Steps (docs/releases.md):
      model-factory release init model_repository --root-key root-a.pem --root-key root-b.pem \\
          --targets-pub targets.pub --snapshot-pub online.pub --timestamp-pub online.pub
      model-factory release add model_repository --targets-key targets.pem --snapshot-key online.pem \\
          --timestamp-key online.pem --policy policy.toml
      model-factory release timestamp model_repository --timestamp-key online.pem   # on a schedule
      model-factory release show model_repository
    """


@release.command("init")
@_REPO
@click.option("--root-key", "root_keys", multiple=True, required=True, type=_KEY,
              help="Private root key (repeat for each; keep them offline afterwards).")
@click.option("--root-threshold", type=click.IntRange(min=1), help="Root signatures required (default: all).")
@click.option("--targets-pub", multiple=True, required=True, type=_KEY, help="Public key of the targets role (repeat).")
@click.option("--targets-threshold", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--snapshot-pub", multiple=True, required=True, type=_KEY, help="Public key of the snapshot role.")
@click.option("--timestamp-pub", multiple=True, required=True, type=_KEY, help="Public key of the timestamp role.")
@click.option("--expires-days", type=click.IntRange(min=1), default=365, show_default=True, help="Root lifetime.")
@_password_file_option
@_ask_password_option
@user_errors
def init(repository: Path, root_keys: tuple[Path, ...], root_threshold: int | None, targets_pub: tuple[Path, ...],
         targets_threshold: int, snapshot_pub: tuple[Path, ...], timestamp_pub: tuple[Path, ...], expires_days: int,
         password_file: Path | None, ask_password: bool) -> None:
    """Create the release root (REPOSITORY/.release/1.root.json), signed by the root keys."""
    from model_factory.signing.release import init_release

    keys = _keys(root_keys, _password(password_file, ask_password))
    path = init_release(repository, keys, {"targets": targets_pub, "snapshot": snapshot_pub,
                                           "timestamp": timestamp_pub},
                        {"root": root_threshold or len(keys), "targets": targets_threshold},
                        dt.timedelta(days=expires_days))
    click.echo(f"release root: {path}\n  copy it beside the trust policy and name it in [release] root "
               "(docs/releases.md); then: model-factory release add")


@release.command("add")
@_REPO
@click.option("--targets-key", multiple=True, required=True, type=_KEY, help="Private targets key (repeat up to the threshold).")
@click.option("--snapshot-key", multiple=True, required=True, type=_KEY, help="Private snapshot key.")
@click.option("--timestamp-key", multiple=True, required=True, type=_KEY, help="Private timestamp key.")
@click.option("--policy", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Verify every model version against this trust policy first.")
@click.option("--timestamp-hours", type=click.IntRange(min=1), default=24, show_default=True,
              help="Timestamp lifetime: re-sign it more often (model-factory release timestamp).")
@_password_file_option
@_ask_password_option
@user_errors
def add(repository: Path, targets_key: tuple[Path, ...], snapshot_key: tuple[Path, ...],
        timestamp_key: tuple[Path, ...], policy: Path | None, timestamp_hours: int, password_file: Path | None,
        ask_password: bool) -> None:
    """Publish the next release: every signed model version now in REPOSITORY."""
    from model_factory.signing import load_policy
    from model_factory.signing.release import add_release, describe_release

    pw = _password(password_file, ask_password)
    number = add_release(repository, _keys(targets_key, pw), _keys(snapshot_key, pw), _keys(timestamp_key, pw),
                         {"timestamp": dt.timedelta(hours=timestamp_hours)},
                         policy=load_policy(policy) if policy else None)
    models = describe_release(repository).models
    click.echo(f"release {number}: " + ", ".join(f"{m} {vs}" for m, vs in models.items()))


@release.command("timestamp")
@_REPO
@click.option("--timestamp-key", multiple=True, required=True, type=_KEY, help="Private timestamp key.")
@click.option("--hours", type=click.IntRange(min=1), default=24, show_default=True, help="Lifetime of the timestamp.")
@_password_file_option
@_ask_password_option
@user_errors
def timestamp(repository: Path, timestamp_key: tuple[Path, ...], hours: int, password_file: Path | None,
              ask_password: bool) -> None:
    """Re-sign the timestamp of the current release (run on a schedule, more often than --hours)."""
    from model_factory.signing.release import refresh_timestamp

    version = refresh_timestamp(repository, _keys(timestamp_key, _password(password_file, ask_password)),
                                dt.timedelta(hours=hours))
    click.echo(f"timestamp {version}, valid {hours} h")


@release.command("rotate-root")
@_REPO
@click.option("--old-root-key", multiple=True, required=True, type=_KEY,
              help="Private key of the current root (repeat up to its threshold).")
@click.option("--new-root-key", multiple=True, type=_KEY, help="Private key of the new root (repeat); omit to keep.")
@click.option("--threshold", type=click.IntRange(min=1), help="New root threshold (default: all new root keys).")
@click.option("--targets-pub", multiple=True, type=_KEY, help="New targets public key(s).")
@click.option("--snapshot-pub", multiple=True, type=_KEY, help="New snapshot public key(s).")
@click.option("--timestamp-pub", multiple=True, type=_KEY, help="New timestamp public key(s).")
@_password_file_option
@_ask_password_option
@user_errors
def rotate_root_cmd(repository: Path, old_root_key: tuple[Path, ...], new_root_key: tuple[Path, ...],
                    threshold: int | None, targets_pub: tuple[Path, ...], snapshot_pub: tuple[Path, ...],
                    timestamp_pub: tuple[Path, ...], password_file: Path | None, ask_password: bool) -> None:
    """Write the next root (new keys), signed by the old root and the new one."""
    from model_factory.signing.release import rotate_root

    pw = _password(password_file, ask_password)
    path = rotate_root(repository, _keys(old_root_key, pw), _keys(new_root_key, pw), threshold,
                       {"targets": targets_pub, "snapshot": snapshot_pub, "timestamp": timestamp_pub})
    click.echo(f"new root: {path}\n  publish with model-factory release add (or timestamp) signed by the new keys")


@release.command("show")
@_REPO
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@user_errors
def show(repository: Path, as_json: bool) -> None:
    """Print the release of REPOSITORY: versions, thresholds, expiries, the model versions released."""
    from model_factory.signing.release import describe_release

    info = describe_release(repository)
    if as_json:
        click.echo(json.dumps(asdict(info), indent=2))
        return
    click.echo(f"release {info.release or '(none yet)'}, root {info.root_version}, timestamp {info.timestamp_version}")
    for role, t in info.thresholds.items():
        click.echo(f"  {role:<9} threshold {t:<7} expires {info.expires.get(role, '-')}")
    for model, versions in info.models.items():
        click.echo(f"  {model}: versions {', '.join(map(str, versions))}")


COMMANDS = [release]
