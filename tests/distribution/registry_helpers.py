"""A real OCI registry for the tests: Debian's docker-registry (CNCF Distribution 2.8) on 127.0.0.1,
with htpasswd (bcrypt) auth and TLS from a CA made here. Started and stopped by the fixtures."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

USER, PASSWORD = "factory", "s3cret-pass"


@dataclass
class TestRegistry:
    host: str  # 127.0.0.1:PORT
    ca: Path
    config: Path  # Docker config.json with the credentials
    wrong_config: Path  # same user, wrong password
    storage: Path  # the registry's filesystem root
    process: subprocess.Popen
    log: Path
    token_server: object = None

    def blob_file(self, digest: str) -> Path:
        hex_ = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hex_[:2] / hex_ / "data"

    def tag_link(self, name: str, tag: str) -> Path:
        return self.storage / "docker/registry/v2/repositories" / name / "_manifests/tags" / tag / "current/link"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_tls(folder: Path) -> tuple[Path, Path, Path]:
    """A test CA and a server certificate for 127.0.0.1 signed by it: (ca.pem, server.pem, server.key)."""
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("test registry CA")).issuer_name(_name("test registry CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_pem, cert_pem, key_pem = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    ca_pem.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return ca_pem, cert_pem, key_pem


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def start_token_service(folder: Path, port: int, tls_cert: Path, tls_key: Path):
    """A Docker token service on 127.0.0.1:port over TLS: basic auth in, an ES256 JWT (x5c) out.

    Returns (the signing certificate for the registry's rootcertbundle, the running server).
    """
    import http.server
    import ssl
    import threading
    import urllib.parse
    import uuid

    from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

    now = dt.datetime.now(dt.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("test token issuer")).issuer_name(_name("test token issuer"))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=30))
            .sign(key, hashes.SHA256()))
    cert_path = folder / "token-signer.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
    good = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):  # noqa: N802 - http.server's name
            if self.headers.get("Authorization") != good:
                self.send_response(401)
                self.end_headers()
                return
            query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
            access = []
            for scope in query.get("scope", []):
                kind, name, actions = scope.split(":")
                access.append({"type": kind, "name": name, "actions": actions.split(",")})
            t = int(time.time())
            claims = {"iss": "test-token-issuer", "sub": USER, "aud": query.get("service", [""])[0], "exp": t + 600,
                      "nbf": t - 10, "iat": t, "jti": str(uuid.uuid4()), "access": access}
            header = {"typ": "JWT", "alg": "ES256", "x5c": [x5c]}
            signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
            r, s_ = decode_dss_signature(key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
            token = f"{signing_input}.{_b64url(r.to_bytes(32, 'big') + s_.to_bytes(32, 'big'))}"
            body = json.dumps({"token": token, "expires_in": 600}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls_cert, tls_key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return cert_path, server


def docker_config(path: Path, host: str, user: str, password: str) -> Path:
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    return path


def start_registry(folder: Path, token: bool = False, tls: bool = True) -> TestRegistry:
    """Start docker-registry with TLS on a free loopback port; wait until it answers.

    Without ``tls`` it talks plain HTTP (what ``--plain-http`` is for), still with htpasswd auth.

    Auth is htpasswd (basic), or with ``token`` the Docker token flow: a small token service here (the
    registry's real JWT verification) that checks the same htpasswd user and signs ES256 tokens.
    """
    from model_factory.serving.server import free_ports

    folder.mkdir(parents=True, exist_ok=True)
    ca, cert, key = make_tls(folder)
    htpasswd = folder / "htpasswd"
    # Distribution reads bcrypt entries only: htpasswd -B (apache2-utils).
    htpasswd.write_text(subprocess.run(["htpasswd", "-Bbn", "-C", "5", USER, PASSWORD], check=True,
                                       capture_output=True, text=True).stdout)
    storage = folder / "storage"
    port, token_port = free_ports(2)
    host = f"127.0.0.1:{port}"
    token_server = None
    if token:
        signer_cert, token_server = start_token_service(folder, token_port, cert, key)
        auth = f"""auth:
  token:
    realm: https://127.0.0.1:{token_port}/token
    service: test-registry
    issuer: test-token-issuer
    rootcertbundle: {signer_cert}
"""
    else:
        auth = f"""auth:
  htpasswd:
    realm: test-registry
    path: {htpasswd}
"""
    config = folder / "config.yml"
    config.write_text(f"""version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
http:
  addr: {host}
  secret: test-secret
""" + (f"""  tls:
    certificate: {cert}
    key: {key}
""" if tls else "") + auth)
    log = folder / "registry.log"
    proc = subprocess.Popen([shutil.which("docker-registry") or "docker-registry", "serve", str(config)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    import requests

    deadline = time.monotonic() + 20
    while True:
        try:
            if requests.get(f"{'https' if tls else 'http'}://{host}/v2/", verify=str(ca),
                            timeout=2).status_code == 401:
                break
        except requests.exceptions.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            if token_server is not None:
                token_server.shutdown()
            raise RuntimeError(f"docker-registry did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    return TestRegistry(host, ca, docker_config(folder / "docker" / "config.json", host, USER, PASSWORD),
                        docker_config(folder / "wrong" / "config.json", host, USER, "wrong-password"),
                        storage, proc, log, token_server)


def stop_registry(reg: TestRegistry) -> None:
    if reg.token_server is not None:
        reg.token_server.shutdown()
    reg.process.terminate()
    try:
        reg.process.wait(10)
    except subprocess.TimeoutExpired:
        reg.process.kill()
        reg.process.wait()


# -- fixtures (imported by the conftest files of tests/distribution and tests/deploy) --

@pytest.fixture(scope="session")
def registry(tmp_path_factory):
    """docker-registry (CNCF Distribution 2.8) with TLS from a test CA and htpasswd auth, for the session."""
    missing = [b for b in ("docker-registry", "htpasswd") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (scripts/setup.sh installs docker-registry and "
                    "apache2-utils as root)")
    reg = start_registry(tmp_path_factory.mktemp("registry"))
    yield reg
    stop_registry(reg)


@pytest.fixture(scope="session")
def plain_registry(tmp_path_factory):
    """The same registry over plain HTTP (htpasswd auth), for ``--plain-http``."""
    missing = [b for b in ("docker-registry", "htpasswd") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (scripts/setup.sh installs docker-registry and "
                    "apache2-utils as root)")
    reg = start_registry(tmp_path_factory.mktemp("plain-registry"), tls=False)
    yield reg
    stop_registry(reg)


@pytest.fixture(scope="session")
def token_registry(tmp_path_factory):
    """The same registry with Docker token auth (a token service here issues the JWTs it verifies)."""
    if shutil.which("docker-registry") is None:
        pytest.skip("docker-registry not installed (scripts/setup.sh installs it as root)")
    reg = start_registry(tmp_path_factory.mktemp("token-registry"), token=True)
    yield reg
    stop_registry(reg)


@pytest.fixture(scope="session")
def oci_keys(tmp_path_factory):
    """A trusted signing key (in ``policy``) and a foreign one, plus the policy file."""
    from cryptography.hazmat.primitives.asymmetric import ec

    sys.path.insert(0, str(Path(__file__).parents[1] / "signing"))
    from signing_helpers import write_key, write_pub

    d = tmp_path_factory.mktemp("oci-keys")
    out = {}
    for label in ("trusted", "foreign"):
        k = ec.generate_private_key(ec.SECP256R1())
        out[label] = (write_key(k, d / f"{label}.pem"), write_pub(k, d / f"{label}.pub"))
    policy = d / "policy.toml"
    policy.write_text(f'version = 1\n[[keys]]\nname = "release"\npath = "{out["trusted"][1]}"\n')
    out["policy"] = policy
    return out


@pytest.fixture
def fake_repo(tmp_path, oci_keys):
    """A repository with model ``enc``, versions 1 and 2, each with a BOM and signed by the trusted key."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "signing"))
    from signing_helpers import build_model

    from model_factory.distribution.bom import write_bom
    from model_factory.signing import SignerConfig, sign_model_version

    repo = tmp_path / "repo"
    build_model(repo / "enc", (1, 2))
    for v in (1, 2):
        write_bom(repo / "enc", v, {"tool_versions": {"onnx": "1.17.0"}, "precisions": ["fp32"]})
        sign_model_version(repo / "enc", v, SignerConfig(oci_keys["trusted"][0]))
    return repo


@pytest.fixture
def reg_options(registry, tmp_path):
    from model_factory.distribution.registry import RegistryOptions

    return RegistryOptions(config=registry.config, ca_file=registry.ca, state_dir=tmp_path / "upload-state")
