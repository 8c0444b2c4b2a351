"""Commands that move models through OCI registries and layouts: ``push``, ``pull``, ``bom``.

Each parses its options, calls one function of :mod:`model_factory.distribution` and prints.
"""

from __future__ import annotations

from pathlib import Path

import click

from model_factory.cli.common import user_errors


def _registry_options(f):
    f = click.option("--registry-config", type=click.Path(dir_okay=False, path_type=Path),
                     help="Docker config.json with the registry's credentials (default: $DOCKER_CONFIG/config.json, "
                          "then ~/.docker/config.json).")(f)
    f = click.option("--ca-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="PEM of the CA that issued the registry's TLS certificate (a private CA).")(f)
    f = click.option("--plain-http", is_flag=True, help="Talk HTTP, not HTTPS (a test registry only).")(f)
    f = click.option("--chunk-mib", type=click.IntRange(min=1), default=64, show_default=True,
                     help="Layers larger than this are uploaded in chunks of this size, resumably.")(f)
    return f


def _options(registry_config, ca_file, plain_http, chunk_mib):
    from model_factory.distribution.registry import RegistryOptions

    state = Path.home() / ".cache" / "model-factory" / "oci-uploads"
    return RegistryOptions(config=registry_config, ca_file=ca_file, plain_http=plain_http,
                           chunk_size=chunk_mib << 20, state_dir=state)


@click.command()
@click.argument("repository", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("reference")
@click.option("--model", required=True, help="Model folder name in REPOSITORY.")
@click.option("--version", type=click.IntRange(min=0), help="Version to push (default: the highest).")
@click.option("--form", type=click.Choice(["modelpack", "modelcar"]), default="modelpack", show_default=True,
              help="modelpack: the CNCF ModelPack artifact `pull` reads; modelcar: an image with the files "
                   "under /models/<model>/ for KServe model cars and image volumes.")
@click.option("--release-file", "release_files", multiple=True, type=click.Path(exists=True, dir_okay=False,
              path_type=Path), help="Release metadata to attach (repeat) instead of REPOSITORY/.release/ (attached by "
                         "default when it exists).")
@_registry_options
@user_errors
def push(repository: Path, reference: str, model: str, version: int | None, form: str,
         release_files: tuple[Path, ...], registry_config, ca_file, plain_http, chunk_mib) -> None:
    """Push a signed model version to REFERENCE, with its signature, provenance, BOM and release attached.

    A repository with signed releases (.release/, docs/releases.md) has its release metadata attached;
    the version must be in its current release.

    \b
    REFERENCE is oci://HOST[:PORT]/NAMESPACE/NAME:TAG or oci-layout:DIR[:TAG] (removable media).
    Examples:
      model-factory push model_repository oci://registry.corp:5000/models/minilm:1 --model minilm --ca-file ca.pem
      model-factory push model_repository oci-layout:/media/usb/models:minilm-1 --model minilm
    """
    from model_factory.cli.common import progress_printer
    from model_factory.distribution.push_pull import push as do_push

    result = do_push(repository, model, reference, version=version, form=form,
                     options=_options(registry_config, ca_file, plain_http, chunk_mib),
                     release_files=release_files, progress=_throttled(progress_printer()))
    click.echo(f"pushed {model} as {result.form} -> {result.reference} ({result.digest})")
    for role, digest in result.referrers.items():
        click.echo(f"  attached {role}: {digest}")


def _throttled(say):
    last = {}

    def progress(what: str, done: int, total: int) -> None:
        step = done * 10 // max(total, 1)
        if total >= (64 << 20) and last.get(what) != step:
            last[what] = step
            say(f"{what}: {done >> 20} of {total >> 20} MiB")

    return progress


@click.command()
@click.argument("reference")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option("--policy", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Trust policy TOML the signature must satisfy.")
@click.option("--expect-version", type=click.IntRange(min=0), help="Refuse any other signed version.")
@click.option("--allow-downgrade", is_flag=True, help="Accept a version older than the one already in DEST.")
@click.option("--release-state", type=click.Path(file_okay=False, path_type=Path),
              help="Where this machine keeps the release state it trusts (default: the policy's [release] "
                   "state_dir). Only with a [release] section.")
@_registry_options
@user_errors
def pull(reference: str, dest: Path, policy: Path, expect_version: int | None, allow_downgrade: bool,
         release_state: Path | None, registry_config, ca_file, plain_http, chunk_mib) -> None:
    """Pull a model from REFERENCE into the repository DEST, verified before anything lands there.

    The signature referrer must be trusted by the policy and cover exactly the manifest's files; every
    blob is hashed; the staged model is verified; only then does DEST/<model> change (one rename).
    With a [release] section in the policy, the attached signed release must list this version and
    be neither older than the release already trusted here (rollback) nor expired (freeze); it then
    becomes DEST/.release/ (unless a newer one is there), so verify, serve and rollout check DEST.

    \b
    Examples:
      model-factory pull oci://registry.corp:5000/models/minilm:1 /models --policy policy.toml --ca-file ca.pem
      model-factory pull oci-layout:/media/usb/models:minilm-1 /models --policy policy.toml
    """
    from model_factory.distribution.push_pull import pull as do_pull

    result = do_pull(reference, dest, policy, options=_options(registry_config, ca_file, plain_http, chunk_mib),
                     expect_version=expect_version, allow_downgrade=allow_downgrade, release_state=release_state)
    click.echo(f"pulled {result.model} version {result.version} ({result.digest}) -> {result.model_dir}, "
               f"signed by {result.signer}; checked {', '.join(result.referrers)}")


@click.command()
@click.argument("repository", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--model", required=True, help="Model folder name in REPOSITORY.")
@click.option("--version", type=click.IntRange(min=0), help="Version (default: the highest).")
@user_errors
def bom(repository: Path, model: str, version: int | None) -> None:
    """Print the CycloneDX 1.7 bill of materials of a model version (JSON).

    \b
    Example:
      model-factory bom model_repository --model minilm > minilm.cdx.json
    """
    from model_factory.distribution.bom import read_bom

    text, signed = read_bom(repository, model, version)
    if not signed:
        click.echo("note: this version has no signed bom.cdx.json; this BOM was built now from its files and "
                   "provenance", err=True)
    click.echo(text, nl=False)


COMMANDS = [push, pull, bom]
