"""A registry repository as a :class:`~.oci_layout.Target`, through oras (auth, sessions) with our own transfer loop.

What customers' registries need, and where it is done:

* **Auth** from the usual Docker config file (``--registry-config``, else ``$DOCKER_CONFIG/config.json``,
  else ``~/.docker/config.json``): basic auth (htpasswd), and token auth (a ``Bearer`` challenge is
  answered by oras' token flow with the same credentials).
* **TLS** with the customer's private CA (``ca_file``), or plain HTTP only when asked (``plain_http``).
* **Retries**: a lost connection or a 5xx is retried a few times with a short back-off; an auth refusal
  is never retried (oras' own retry would wait minutes on a wrong password).
* **Large layers**: uploads past ``chunk_size`` go in chunks (POST, PATCH..., PUT); the upload session is
  recorded after every acknowledged chunk in ``state_dir``, so a killed push resumes where the registry
  stands. Downloads resume a ``.part`` file with an HTTP range request.
* **Errors** name what is wrong: a wrong tag (with the tags that exist), a missing repository, a
  refused login, an unknown CA.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_factory.distribution.oci_layout import (OCI_INDEX, OCI_MANIFEST, Blob, Progress, StreamCheck, check_digest,
                                                   commit_checked)
from model_factory.errors import FactoryError, require

DEFAULT_CHUNK = 64 << 20
_ACCEPT = ", ".join([OCI_MANIFEST, OCI_INDEX, "application/vnd.docker.distribution.manifest.v2+json"])
_REF = re.compile(r"^oci://(?P<host>[^/]+)/(?P<name>[a-z0-9]+(?:[._/-][a-z0-9]+)*)"
                  r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9._-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")


@dataclass(frozen=True)
class RegistryRef:
    """``oci://HOST[:PORT]/NAMESPACE/NAME[:TAG][@sha256:...]``."""

    host: str
    name: str
    tag: str | None
    digest: str | None

    @property
    def reference(self) -> str:
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        return f"oci://{self.host}/{self.name}" + (f":{self.tag}" if self.tag else "") + \
            (f"@{self.digest}" if self.digest else "")


def parse_registry_ref(text: str) -> RegistryRef:
    """Parse ``oci://...``; a FactoryError shows the expected form."""
    m = _REF.match(text or "")
    if not m:
        raise FactoryError(f"{text!r} is not a registry reference. Fix: write oci://HOST[:PORT]/NAMESPACE/NAME:TAG "
                           "(lowercase name), e.g. oci://registry.example:5000/models/minilm:1")
    return RegistryRef(m["host"], m["name"], m["tag"], m["digest"])


@dataclass(frozen=True)
class RegistryOptions:
    """How to reach a registry: credentials file, private CA, plain HTTP, chunking and resumption."""

    config: Path | None = None
    ca_file: Path | None = None
    plain_http: bool = False
    chunk_size: int = DEFAULT_CHUNK
    state_dir: Path | None = None
    attempts: int = 3
    timeout_s: float = 60.0


def docker_config_path(explicit: Path | None) -> Path | None:
    """The Docker config file to read credentials from (the first that is named or exists)."""
    if explicit is not None:
        if not Path(explicit).is_file():
            raise FactoryError(f"registry config {explicit} does not exist. Fix: pass the Docker config.json that "
                               "holds the registry's credentials (docker login writes one)")
        return Path(explicit)
    env = os.environ.get("DOCKER_CONFIG")
    for p in ([Path(env) / "config.json"] if env else []) + [Path.home() / ".docker" / "config.json"]:
        if p.is_file():
            return p
    return None


_ERROR_BODY_MAX = 64 << 10  # an error document is small: never read more of a failed response than this


def _error_body(resp: Any) -> str:
    """The start of a *failed* response's body ('' for a success: a success's body is the caller's to read)."""
    if resp.status_code < 400:
        return ""
    cached = getattr(resp, "_factory_error_body", None)
    if cached is None:  # read once: a streamed body cannot be read twice
        try:
            cached = next(resp.iter_content(_ERROR_BODY_MAX), b"").decode("utf-8", "replace")
        except Exception:  # noqa: BLE001 - a body that cannot be read says nothing more than the status
            cached = ""
        resp._factory_error_body = cached
    return cached


def _error_list(resp: Any) -> list[dict[str, Any]]:
    """The registry's error entries (``{"errors": [{"code", "message"}]}``) of a failed response, else []."""
    text = _error_body(resp)
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return []
    errors = doc.get("errors") if isinstance(doc, dict) else None
    return [e for e in errors if isinstance(e, dict)] if isinstance(errors, list) else []


def _errors_of(resp: Any) -> str:
    errors = _error_list(resp)
    if errors:
        return "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
    return " ".join(_error_body(resp).split())[:200]


def _codes(resp: Any) -> set[str]:
    return {str(e.get("code")) for e in _error_list(resp)}


def _json_field(resp: Any, key: str) -> list[Any]:
    """A list field of a successful JSON answer (tags, referrers); [] when the body is not that shape."""
    try:
        doc = resp.json()
    except ValueError:
        return []
    value = doc.get(key) if isinstance(doc, dict) else None
    return list(value) if isinstance(value, list) else []


class RegistryTarget:
    """One repository of one registry."""

    def __init__(self, ref: RegistryRef, options: RegistryOptions = RegistryOptions()):
        require("oras", "distribution")
        import oras.provider

        self.ref, self.options = ref, options
        self.label = f"oci://{ref.host}/{ref.name}"
        if options.ca_file is not None and not Path(options.ca_file).is_file():
            raise FactoryError(f"CA file {options.ca_file} does not exist. Fix: pass the PEM of the registry's CA")
        verify: bool | str = str(options.ca_file) if options.ca_file else True
        self._scheme = "http" if options.plain_http else "https"
        self._base = f"{self._scheme}://{ref.host}/v2/{ref.name}"
        self._oras = oras.provider.Registry(hostname=ref.host, insecure=options.plain_http, tls_verify=verify,
                                            auth_backend="basic")
        self._config = docker_config_path(options.config)
        self._auth_header: dict[str, str] = {}
        self._login()

    # -- transport ---------------------------------------------------------------------------------------

    def _send(self, method: str, url: str, headers: dict[str, str] | None = None, data: bytes | None = None,
              stream: bool = False, auth: bool = True, renew: bool = True) -> Any:
        resp = self._send_once(method, url, headers, data, stream, auth)
        if resp.status_code == 401 and auth and renew and self._auth_header.get("Authorization", "").startswith(
                "Bearer"):
            # A token expired during a long transfer: ask for a new one, once.
            resp.close()
            self._login()
            resp = self._send_once(method, url, headers, data, stream, auth)
        return resp

    def _send_once(self, method: str, url: str, headers: dict[str, str] | None, data: bytes | None, stream: bool,
                   auth: bool) -> Any:
        import requests

        h = dict(headers or {})
        if auth:
            h.update(self._auth_header)
        last: Exception | None = None
        for attempt in range(self.options.attempts):
            try:
                resp = self._oras.session.request(method, url, headers=h, data=data, stream=stream,
                                                  verify=self._oras._tls_verify, timeout=self.options.timeout_s)
            except requests.exceptions.SSLError as exc:
                raise FactoryError(f"TLS to {self.ref.host} failed ({str(exc)[:160]}). Fix: pass the registry's "
                                   "CA certificate with --ca-file (a private CA is not in the system store)") from exc
            except requests.exceptions.ConnectionError as exc:
                last = exc
            else:
                if resp.status_code < 500:
                    return resp
                last = FactoryError(f"{self.ref.host} answered {resp.status_code}: {_errors_of(resp)}")
            time.sleep(0.5 * 2 ** attempt)
        raise FactoryError(f"cannot reach registry {self.ref.host} ({last}) after {self.options.attempts} tries. "
                           "Fix: check the address and port, and that the registry runs") from last

    def _login(self) -> None:
        """Answer the registry's challenge (basic, or bearer token) with the Docker config's credentials."""
        resp = self._send("GET", f"{self._scheme}://{self.ref.host}/v2/", auth=False)
        if resp.status_code == 200:
            return
        if resp.status_code != 401:
            raise FactoryError(f"{self.ref.host} does not answer as an OCI registry (GET /v2/ gave "
                               f"{resp.status_code}). Fix: check the address")
        challenge = resp.headers.get("WWW-Authenticate", "")
        auth = self._credentials()
        if challenge.lower().startswith("basic"):
            self._auth_header = {"Authorization": f"Basic {auth}"}
        else:
            import oras.auth
            import oras.auth.utils

            token = oras.auth.get_auth_backend("token", self._oras.session, self.options.plain_http,
                                               tls_verify=self._oras._tls_verify)
            token._basic_auth = auth
            h = oras.auth.utils.parse_auth_header(challenge)
            h.scope = f"repository:{self.ref.name}:pull,push"
            value = token.request_token(h)
            if not value:
                raise self._refused()
            self._auth_header = {"Authorization": f"Bearer {value}"}
        check = self._send("GET", f"{self._scheme}://{self.ref.host}/v2/", renew=False)
        if check.status_code in (401, 403):
            raise self._refused()

    def _credentials(self) -> str:
        import oras.auth.utils

        if self._config is None:
            raise FactoryError(f"registry {self.ref.host} needs a login, and no Docker config file holds "
                               "credentials. Fix: docker login (or write ~/.docker/config.json), or pass "
                               "--registry-config / set DOCKER_CONFIG")
        auths = oras.auth.utils.load_configs([str(self._config)]).get("auths", {})
        for host in (self.ref.host, f"https://{self.ref.host}", f"http://{self.ref.host}"):
            if (auths.get(host) or {}).get("auth"):
                return auths[host]["auth"]
        raise FactoryError(f"registry {self.ref.host} needs a login, and {self._config} has no credentials for it. "
                           f"Fix: add an auths entry for {self.ref.host} (docker login {self.ref.host})")

    def _refused(self) -> FactoryError:
        return FactoryError(f"registry {self.ref.host} refused the login from {self._config}. Fix: check the user "
                            "name and password there (docker login again), and that the account may use "
                            f"repository {self.ref.name}")

    def _check(self, resp: Any, what: str) -> Any:
        if resp.status_code in (401, 403):
            raise FactoryError(f"{what}: registry {self.ref.host} refused access ({_errors_of(resp)}). Fix: check "
                               f"the credentials in {self._config} and the account's rights on {self.ref.name}")
        if "NAME_UNKNOWN" in _codes(resp):
            raise FactoryError(f"{what}: repository {self.label} does not exist, and the registry does not create "
                               f"repositories on push. Fix: create {self.ref.name} (Harbor: the project) first")
        if resp.status_code >= 400:
            raise FactoryError(f"{what}: {self.ref.host} answered {resp.status_code} ({_errors_of(resp)})")
        return resp

    def _url(self, location: str) -> str:
        return location if location.startswith("http") else f"{self._scheme}://{self.ref.host}{location}"

    # -- blobs ---------------------------------------------------------------------------------------------

    def has_blob(self, digest: str) -> bool:
        return self._send("HEAD", f"{self._base}/blobs/{check_digest(digest)}").status_code == 200

    def put_blob(self, blob: Blob, progress: Progress | None = None) -> None:
        if self.has_blob(blob.digest):
            if progress:
                progress(f"blob {blob.digest[:19]} (already there)", blob.size, blob.size)
            return
        if blob.data is not None or blob.size <= self.options.chunk_size:
            data = blob.data if blob.data is not None else Path(blob.path).read_bytes()  # type: ignore[arg-type]
            start = self._check(self._send("POST", f"{self._base}/blobs/uploads/"), "starting an upload")
            url = self._url(start.headers["Location"])
            sep = "&" if "?" in url else "?"
            self._check(self._send("PUT", f"{url}{sep}digest={blob.digest}", data=data,
                                   headers={"Content-Type": "application/octet-stream"}), f"uploading {blob.digest}")
            if progress:
                progress(f"blob {blob.digest[:19]}", blob.size, blob.size)
            return
        self._chunked_upload(blob, progress)

    def _state_file(self, digest: str) -> Path | None:
        if self.options.state_dir is None:
            return None
        d = Path(self.options.state_dir)
        d.mkdir(parents=True, exist_ok=True)
        return d / f"{self.ref.host.replace(':', '_')}_{self.ref.name.replace('/', '_')}_{digest[7:]}.json"

    def _resume_point(self, state: Path | None) -> tuple[str, int] | None:
        """The recorded upload session and its offset, if the registry still holds it at that offset."""
        if state is None or not state.is_file():
            return None
        try:
            recorded = json.loads(state.read_text())
            url, offset = recorded["location"], int(recorded["offset"])
        except (OSError, ValueError, KeyError):
            return None
        resp = self._send("GET", url)
        if resp.status_code != 204:
            return None  # the registry dropped the session (or it broke mid-chunk): start again
        rng = resp.headers.get("Range", "0-0")
        end = int(rng.rsplit("-", 1)[1]) if "-" in rng else -1
        if end + 1 != offset and not (rng == "0-0" and offset <= 1):
            return None
        return self._url(resp.headers.get("Location", url)), offset

    def _chunked_upload(self, blob: Blob, progress: Progress | None) -> None:
        assert blob.path is not None
        state = self._state_file(blob.digest)
        resumed = self._resume_point(state)
        if resumed is None:
            start = self._check(self._send("POST", f"{self._base}/blobs/uploads/",
                                           headers={"Content-Length": "0"}), "starting a chunked upload")
            url, offset = self._url(start.headers["Location"]), 0
        else:
            url, offset = resumed
        with open(blob.path, "rb") as f:
            f.seek(offset)
            while offset < blob.size:
                chunk = f.read(self.options.chunk_size)
                if not chunk:
                    raise FactoryError(f"{blob.path} shrank while it was uploaded. Fix: do not change the model "
                                       "while pushing it")
                resp = self._check(self._send("PATCH", url, data=chunk, headers={
                    "Content-Type": "application/octet-stream", "Content-Length": str(len(chunk)),
                    "Content-Range": f"{offset}-{offset + len(chunk) - 1}"}), f"uploading a chunk of {blob.path.name}")
                offset += len(chunk)
                url = self._url(resp.headers["Location"])
                if state is not None:
                    state.write_text(json.dumps({"location": url, "offset": offset, "digest": blob.digest}))
                if progress:
                    progress(f"{blob.path.name} (chunked)", offset, blob.size)
        sep = "&" if "?" in url else "?"
        self._check(self._send("PUT", f"{url}{sep}digest={blob.digest}", headers={"Content-Length": "0"}),
                    f"finishing the upload of {blob.path.name}")
        if state is not None:
            state.unlink(missing_ok=True)

    def fetch_blob(self, digest: str, size: int, dest: Path, progress: Progress | None = None) -> None:
        dest = Path(dest)
        part = dest.with_name(dest.name + ".part")
        check = StreamCheck(digest, size, f"blob {digest[:19]} from {self.label}")
        have = part.stat().st_size if part.is_file() else 0
        if have > size:
            part.unlink()
            have = 0
        if have:
            with open(part, "rb") as f:  # the bytes already here count towards the digest
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    check.update(chunk)
        headers = {"Range": f"bytes={have}-"} if have else {}
        if have == size and size:
            headers = {}
        with self._send("GET", f"{self._base}/blobs/{check_digest(digest)}", headers=headers, stream=True) as resp:
            if resp.status_code == 404:
                raise FactoryError(f"{self.label} has no blob {digest[:19]}... that the manifest lists: the artifact "
                                   "is incomplete. Fix: push the model again")
            self._check(resp, f"downloading blob {digest[:19]}")
            mode = "ab"
            if have and resp.status_code != 206:  # no range support: start again
                check, mode = StreamCheck(digest, size, check.what), "wb"
            with open(part, mode) as out:
                for chunk in resp.iter_content(1 << 20):
                    check.update(chunk)
                    out.write(chunk)
                    if progress:
                        progress(f"blob {digest[:19]}", check.n, size)
        commit_checked(check, part, dest)

    # -- manifests -----------------------------------------------------------------------------------------

    def put_manifest(self, data: bytes, media_type: str, reference: str) -> bool:
        resp = self._send("PUT", f"{self._base}/manifests/{reference}", data=data,
                          headers={"Content-Type": media_type})
        if resp.status_code == 404 or "NAME_UNKNOWN" in _codes(resp):
            raise FactoryError(f"{self.label} does not exist and the registry did not create it. Fix: create the "
                               f"repository (or project) {self.ref.name} in the registry first")
        self._check(resp, f"storing manifest {reference}")
        return bool(resp.headers.get("OCI-Subject"))

    def get_manifest(self, reference: str) -> tuple[bytes, str]:
        from model_factory.distribution.oci_layout import sha256_bytes

        resp = self._send("GET", f"{self._base}/manifests/{reference}", headers={"Accept": _ACCEPT})
        if resp.status_code == 404:
            tags = self._send("GET", f"{self._base}/tags/list")
            if tags.status_code == 404 or "NAME_UNKNOWN" in _codes(tags):
                raise FactoryError(f"repository {self.label} does not exist. Fix: check the namespace and name "
                                   "(push the model there first)")
            names = sorted(str(t) for t in (_json_field(tags, "tags") if tags.status_code == 200 else []))
            shown = [t for t in names if not t.startswith("sha256-")]
            raise FactoryError(f"{self.label} has no {'manifest' if reference.startswith('sha256:') else 'tag'} "
                               f"{reference!r}. Fix: use one of its tags: {', '.join(shown) or 'none'}")
        self._check(resp, f"reading manifest {reference}")
        data = resp.content
        digest = sha256_bytes(data)
        if reference.startswith("sha256:") and digest != reference:
            raise FactoryError(f"{self.label} returned a manifest that does not match digest {reference}: tampered "
                               "or damaged. Fix: push the model again")
        return data, digest

    def referrers_api(self, digest: str) -> list[dict[str, Any]] | None:
        resp = self._send("GET", f"{self._base}/referrers/{check_digest(digest)}", headers={"Accept": OCI_INDEX})
        if resp.status_code != 200 or not resp.headers.get("Content-Type", "").startswith(OCI_INDEX):
            return None  # no referrers API (CNCF Distribution 2.8): the caller uses the tag schema
        return [m for m in _json_field(resp, "manifests") if isinstance(m, dict)]
