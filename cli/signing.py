"""Commands for offline signing: ``sign``, ``verify`` and ``keygen``.

Each command parses its options, calls one function of
:mod:`model_factory.signing` and prints; a FactoryError becomes a clean
message and exit status 1 (``user_errors``).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from model_factory.cli.common import user_errors
from model_factory.errors import FactoryError

_password_file_option = click.option(
    "--password-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="File whose first line is the private key's password.")
_ask_password_option = click.option(
    "--ask-password", is_flag=True, help="Prompt for the private key's password (not echoed).")


def _password(password_file: Path | None, ask: bool, confirm: bool = False) -> bytes | None:
    if password_file and ask:
        raise click.UsageError("give --password-file or --ask-password, not both")
    if password_file:
        lines = password_file.read_bytes().splitlines()
        return lines[0] if lines and lines[0] else None
    if ask:
        return click.prompt("Key password", hide_input=True, confirmation_prompt=confirm).encode()
    return None


@click.command()
@click.argument("repository", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--key", "private_key", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Private key (PEM) to sign with.")
@click.option("--cert-chain", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Signing certificate, then its intermediates (repeat, or one PEM file holding all). "
                   "Omit to sign in key mode.")
@_password_file_option
@_ask_password_option
@click.option("--model", help="Sign only this model (with --version).")
@click.option("--version", "version", type=click.IntRange(min=0), help="Sign only this version of --model.")
@click.option("--provenance", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="JSON file of build facts to sign as provenance (see docs/signing.md).")
@user_errors
def sign(repository: Path, private_key: Path, cert_chain: tuple[Path, ...], password_file: Path | None,
         ask_password: bool, model: str | None, version: int | None, provenance: Path | None) -> None:
    """Sign every model version in REPOSITORY (one bundle per version).

    Each version's signature covers config.pbtxt, the version folder (with the
    backend code) and every other file of the model folder, and is written to
    <model>/<version>.sig; the provenance, if given, to
    <model>/<version>.provenance.sig.

    \b
    Examples:
      model-factory sign model_repository --key keys/signing-key.pem
      model-factory sign model_repository --key leaf.key --cert-chain leaf.pem --cert-chain intermediate.pem
      model-factory sign model_repository --key k.pem --model minilm --version 1 --provenance build.json
    """
    from model_factory.signing import SignerConfig, sign_model_version, sign_repository

    if (model is None) != (version is None):
        raise click.UsageError("give --model and --version together (or neither, to sign the whole repository)")
    facts = None
    if provenance is not None:
        try:
            facts = json.loads(provenance.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FactoryError(f"provenance file {provenance} is not JSON ({exc}). Fix: write the build facts "
                               "as a JSON object") from exc
    signer = SignerConfig(private_key, _password(password_file, ask_password), tuple(cert_chain))
    if model is not None and version is not None:
        paths = [sign_model_version(repository / model, version, signer, facts)]
    else:
        paths = sign_repository(repository, signer, facts)
    for p in paths:
        click.echo(f"signed {p.parent.name} version {p.name.split('.')[0]} -> {p}")


@click.command()
@click.argument("repository", type=click.Path(file_okay=False, path_type=Path))
@click.option("--policy", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Trust policy TOML: trusted keys and/or CA roots, identities, CRLs, provenance.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON record per model version.")
@click.option("--no-release", is_flag=True,
              help="Check signatures only, not the policy's [release] (a factory's check before releasing).")
@click.pass_context
@user_errors
def verify(ctx: click.Context, repository: Path, policy: Path, as_json: bool, no_release: bool) -> None:
    """Verify every model version in REPOSITORY against a trust policy.

    Exit status 0 only when every version passes; 1 on any failure or doubt
    (unsigned, changed, extra or missing file, untrusted or expired signer,
    revoked certificate, missing provenance, ...). With a [release] section in
    the policy, also a release that is older than one trusted, expired, mixed,
    under-signed or from a root the trusted root did not sign (docs/releases.md).

    \b
    Examples:
      model-factory verify --policy trust-policy.toml model_repository
      model-factory verify --json --policy trust-policy.toml model_repository > verify.json
    """
    from model_factory.signing import check_release, load_policy, verify_repository

    trust = load_policy(policy)
    results = verify_repository(repository, trust)
    if not no_release:
        results = check_release(repository, trust, results)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        for r in results:
            where = r.model if r.version is None else f"{r.model}/{r.version}"
            if r.ok:
                click.echo(f"OK    {where}  signed by {r.signer} ({r.files} files)")
            else:
                click.echo(f"FAIL  {where}")
                for reason in r.reasons:
                    click.echo(f"      - {reason}")
        failed = sum(not r.ok for r in results)
        click.echo(f"{len(results) - failed} of {len(results)} model versions verified"
                   + (f"; {failed} failed" if failed else ""))
    if not all(r.ok for r in results):
        ctx.exit(1)


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--curve", type=click.Choice(["P-256", "P-384", "P-521"]), default="P-256", show_default=True,
              help="ECDSA curve.")
@_password_file_option
@_ask_password_option
@click.option("--csr-subject", help='Also write a CSR for the in-house CA, e.g. "CN=model-factory CI,O=Example".')
@user_errors
def keygen(out_dir: Path, curve: str, password_file: Path | None, ask_password: bool,
           csr_subject: str | None) -> None:
    """Create a signing key pair in OUT_DIR (for an air-gapped machine).

    Writes signing-key.pem (private, mode 0600, encrypted when a password is
    given), signing-key.pub, and with --csr-subject a signing-key.csr to send to
    the CA. Existing files are never overwritten.

    \b
    Examples:
      model-factory keygen keys/ --ask-password
      model-factory keygen keys/ --curve P-384 --csr-subject "CN=model-factory release,O=Example Corp"
    """
    from model_factory.signing import generate_keypair

    paths = generate_keypair(out_dir, curve, _password(password_file, ask_password, confirm=True), csr_subject)
    click.echo(f"private key: {paths.private_key} (keep it offline; mode 0600)")
    click.echo(f"public key:  {paths.public_key} (list it in the trust policy's [[keys]])")
    if paths.csr is not None:
        click.echo(f"CSR:         {paths.csr} (send it to your CA; sign with --cert-chain once issued)")


COMMANDS = [sign, verify, keygen]
