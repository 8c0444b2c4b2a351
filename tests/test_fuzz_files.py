"""Property-based: the files users (and attackers) hand us — recipes, trust policies, signature bundles,
certificates, CRLs, calibration files — truncated, huge, of wrong types, deeply nested or not UTF-8 are
refused with one clean line naming the problem and the fix: a FactoryError, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from model_factory.errors import FactoryError

FAST = settings(max_examples=40, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])

EXAMPLE_RECIPE = (Path(__file__).resolve().parents[1] / "model_factory" / "examples" / "minilm.toml").read_text()


def _mutations(valid: bytes) -> st.SearchStrategy[bytes]:
    """The valid file truncated, with a span replaced by junk, or junk outright (non-UTF-8 included)."""
    cut = st.integers(0, max(0, len(valid) - 1)).map(lambda n: valid[:n])
    spliced = st.tuples(st.integers(0, len(valid)), st.integers(0, 40), st.binary(max_size=40)).map(
        lambda t: valid[:t[0]] + t[2] + valid[t[0] + t[1]:])
    return st.one_of(cut, spliced, st.binary(max_size=300), st.text(max_size=300).map(str.encode))


def _nested(depth: int, open_: str, close: str, prefix: str = "") -> bytes:
    return (prefix + open_ * depth + close * depth).encode()


def _check_clean(exc: FactoryError) -> None:
    msg = str(exc)
    assert msg.strip(), "an empty message"
    assert "Traceback" not in msg


# --------------------------------------------------------------------------- recipes


@FAST
@given(data=_mutations(EXAMPLE_RECIPE.encode()))
@example(data=_nested(5000, "[", "]", "precisions = "))
@example(data=_nested(5000, "{", "}", "x = ").replace(b"{}", b"{a={}}", 1))
@example(data=b"\xff\xfe[model]\n")
@example(data=b"[model]\nname = 1\n")
def test_a_broken_recipe_is_a_factory_error(tmp_path_factory, data: bytes) -> None:
    from model_factory.recipe import load_recipe

    path = tmp_path_factory.mktemp("recipe") / "r.toml"
    path.write_bytes(data)
    try:
        load_recipe(path)
    except FactoryError as exc:
        _check_clean(exc)


# --------------------------------------------------------------------------- trust policies

VALID_POLICY = b'''[[keys]]
path = "k.pub"

[provenance]
required = true
'''


@FAST
@given(data=_mutations(VALID_POLICY))
@example(data=_nested(5000, "[", "]", "x = "))
@example(data=b"[[keys]]\npath = 5\n")
@example(data=b"\x00\x01\x02")
def test_a_broken_trust_policy_is_a_factory_error(tmp_path_factory, data: bytes) -> None:
    from model_factory.signing import load_policy

    path = tmp_path_factory.mktemp("policy") / "policy.toml"
    path.write_bytes(data)
    try:
        load_policy(path)
    except FactoryError as exc:
        _check_clean(exc)


# --------------------------------------------------------------------------- signature bundles


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """A tiny signed model, its policy and its valid bundle bytes."""
    from model_factory.demo import write_key_policy
    from model_factory.signing import SignerConfig, generate_keypair, sign_model_version

    root = tmp_path_factory.mktemp("signed")
    model = root / "repo" / "m"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('name: "m"\n')
    (model / "1" / "model.onnx").write_bytes(b"weights")
    keys = generate_keypair(root / "keys")
    sig = sign_model_version(model, 1, SignerConfig(private_key=keys.private_key, password=None))
    policy = root / "policy.toml"
    write_key_policy(policy, [keys.public_key])
    policy.write_text(policy.read_text().replace("required = true", "required = false"))
    return root / "repo", policy, sig.read_bytes()


@FAST
@given(data=st.one_of(st.binary(max_size=400), st.just(b"")))
@example(data=_nested(100_000, "[", "]"))
@example(data=_nested(100_000, '{"a":', "}").replace(b"}", b"", 1) + b"1}")
@example(data=b'{"mediaType": 5}')
@example(data=b'"\xff"')
def test_a_broken_signature_bundle_fails_verification_with_a_reason(signed, data: bytes) -> None:
    from model_factory.signing import load_policy, verify_repository
    from model_factory.signing.bundle import BundleError, parse_bundle

    try:
        parse_bundle(data)
    except BundleError as exc:
        assert str(exc).strip()
    repo, policy, valid = signed
    sig = repo / "m" / "1.sig"
    sig.write_bytes(data)
    try:
        (result,) = verify_repository(repo, load_policy(policy))
        assert not result.ok and result.reasons and all(r.strip() for r in result.reasons)
    finally:
        sig.write_bytes(valid)


def _same_json(a: bytes, b: bytes) -> bool:
    """Whether two bundles carry the same signed content: media type, public key and DSSE envelope, parsed.

    Whitespace between tokens changes nothing, nor does a key the verifier never reads (``tlogEntries``
    renamed by a spliced space, found by this test: offline verification has no transparency log)."""
    import json

    try:
        x, y = json.loads(a), json.loads(b)
    except ValueError:  # UnicodeDecodeError included
        return False
    if not (isinstance(x, dict) and isinstance(y, dict)):
        return False

    def signed(d: dict) -> tuple:
        material = d.get("verificationMaterial")
        key = material.get("publicKey") if isinstance(material, dict) else None
        return d.get("mediaType"), key, d.get("dsseEnvelope")

    return signed(x) == signed(y)


@FAST
@given(draw=st.data())
def test_a_truncated_or_spliced_bundle_fails_verification(signed, draw) -> None:
    # Mutations of the real bundle: cut anywhere, spans replaced.
    from model_factory.signing import load_policy, verify_repository

    repo, policy, valid = signed
    mutated = draw.draw(_mutations(valid))
    sig = repo / "m" / "1.sig"
    sig.write_bytes(mutated)
    try:
        (result,) = verify_repository(repo, load_policy(policy))
        # A bundle is JSON: a mutation that leaves its signed content as it was (whitespace between tokens, a
        # key the verifier never reads) is the same bundle and verifies; any other change must not.
        assert result.ok == (mutated == valid or _same_json(mutated, valid))
        assert result.ok or result.reasons
    finally:
        sig.write_bytes(valid)


def test_whitespace_around_a_bundle_changes_nothing(signed) -> None:
    """The cases hypothesis found: a tab before the bundle's first brace, a space inside a key nothing reads."""
    from model_factory.signing import load_policy, verify_repository

    repo, policy, valid = signed
    sig = repo / "m" / "1.sig"
    try:
        key = valid.index(b'"tlogEntries"') + 2  # "t logEntries": a key offline verification never reads
        for mutated in (b"\t" + valid, valid + b"\n ", valid[:key] + b" " + valid[key:]):
            sig.write_bytes(mutated)
            (result,) = verify_repository(repo, load_policy(policy))
            assert result.ok and _same_json(mutated, valid)
    finally:
        sig.write_bytes(valid)


# --------------------------------------------------------------------------- certificates and CRLs


@FAST
@given(data=st.one_of(st.binary(max_size=400),
                      st.binary(max_size=200).map(lambda b: b"-----BEGIN CERTIFICATE-----\n" + b
                                                  + b"\n-----END CERTIFICATE-----\n"),
                      st.binary(max_size=200).map(lambda b: b"-----BEGIN X509 CRL-----\n" + b
                                                  + b"\n-----END X509 CRL-----\n")))
@example(data=b"\x30\x82\xff\xff" + b"\x30" * 64)  # a DER header that promises more than is there
def test_broken_certificates_and_crls_are_factory_errors(tmp_path_factory, data: bytes) -> None:
    from model_factory.signing.certificates import load_certificates, load_crl

    path = tmp_path_factory.mktemp("pki") / "file.pem"
    path.write_bytes(data)
    for load in (load_certificates, load_crl):
        try:
            load(path)
        except FactoryError as exc:
            _check_clean(exc)


# --------------------------------------------------------------------------- calibration files


@FAST
@given(data=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode),
                      st.lists(st.one_of(st.just('{"text": "a"}'), st.just('{"text": 5}'), st.just("[1, 2]"),
                                         st.just('{"query": "q"}'), st.text(max_size=20)), max_size=5)
                      .map(lambda lines: "\n".join(lines).encode())),
       suffix=st.sampled_from([".txt", ".jsonl", ".npz"]))
@example(data=b"\xff\xfe\x00bad", suffix=".jsonl")
@example(data=_nested(100_000, "[", "]"), suffix=".jsonl")
@example(data=b"PK\x03\x04" + b"\x00" * 40, suffix=".npz")
def test_a_broken_calibration_file_is_a_factory_error(tmp_path_factory, data: bytes, suffix: str) -> None:
    from model_factory.build_engines.calibration import read_samples

    path = tmp_path_factory.mktemp("calib") / f"calib{suffix}"
    path.write_bytes(data)
    try:
        read_samples(path)
    except FactoryError as exc:
        _check_clean(exc)


def test_a_huge_file_is_refused_in_bounded_time_and_memory(tmp_path: Path) -> None:
    """64 MiB of junk where a recipe, a policy or a bundle should be: one clean error each (resource limits
    are set by the test process itself: 1 GiB of address space beyond what is mapped now)."""
    import subprocess
    import sys

    big = tmp_path / "big"
    with big.open("wb") as f:
        f.write(b"x = [" + b"1," * (32 << 20) + b"]\n")
    code = f'''
import resource, sys
from pathlib import Path
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + (1 << 30), hard))
from model_factory.errors import FactoryError
from model_factory.recipe import load_recipe
from model_factory.signing import load_policy
from model_factory.signing.bundle import BundleError, parse_bundle
p = Path({str(big)!r})
for load in (load_recipe, load_policy):
    try:
        load(p)
        print("accepted", load.__name__)
    except FactoryError as exc:
        print("refused", load.__name__, str(exc)[:80].replace(chr(10), " "))
try:
    parse_bundle(p.read_bytes())
except BundleError as exc:
    print("refused bundle", str(exc)[:80])
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [line.split()[0] + " " + line.split()[1] for line in out.stdout.splitlines()] == \
        ["refused load_recipe", "refused load_policy", "refused bundle"], out.stdout


# --------------------------------------------------------------------------- through the CLI


@pytest.mark.parametrize("command", ["verify", "build"])
def test_the_cli_prints_one_line_for_a_broken_file(tmp_path: Path, command: str) -> None:
    from model_factory.cli.main import main

    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe" + _nested(3000, "[", "]", "x = "))
    (tmp_path / "repo").mkdir()
    args = ["verify", "--policy", str(bad), str(tmp_path / "repo")] if command == "verify" else ["build", str(bad)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in result.output, result.output
    assert not list((tmp_path / "repo").iterdir())  # no partial output
