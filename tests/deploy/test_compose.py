"""Contracts of docker-compose.yml and the Dockerfiles, checked without a Docker engine.

The file is parsed and interpolated here the way Compose does (``${VAR:-default}``),
then each promise of docs/deployment.md is checked: what is mounted where and
read-only, which secret goes to which service, ports, GPU reservation, health
check, no network for the factory, image variables with defaults that match the
Dockerfiles and .env.example. Where a Compose CLI is installed (``docker compose``
or the v1 ``docker-compose``), ``config`` must accept the file too (it needs no
engine); where check-jsonschema is installed, the file must match the Compose spec.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

import pytest
import yaml

from .validators import check_jsonschema

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
FACTORY_DOCKERFILE = ROOT / "docker" / "factory.Dockerfile"
TRITON_DOCKERFILE = ROOT / "docker" / "triton.Dockerfile"
ENTRYPOINT = ROOT / "docker" / "factory-entrypoint.sh"
ENV_EXAMPLE = ROOT / ".env.example"

SERVE_COMMAND = ["model-factory", "serve", "--host", "0.0.0.0", "--policy", "/run/secrets/trust_policy",
                 "--openai-port", "9000", "/models"]

# --------------------------------------------------------------------------- Compose interpolation

_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>.*))?$", re.S)


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution for one string (``$$``, ``$V``, ``${V}``, ``${V:-d}``, ``${V-d}``, ``${V:?e}``)."""
    def sub(m: re.Match) -> str:
        if m.group("escaped"):
            return "$"
        if m.group("named"):
            return env.get(m.group("named"), "")
        b = _BRACED.match(m.group("braced"))
        assert b, f"bad variable syntax: {m.group(0)}"
        name, op, arg = b.group("name"), b.group("op"), b.group("arg")
        val = env.get(name)
        if op == ":-":
            return val if val else arg
        if op == "-":
            return arg if val is None else val
        if op in (":?", "?"):
            if val is None or (op == ":?" and not val):
                raise KeyError(f"{name}: {arg}")
            return val
        return val or ""
    return _VAR.sub(sub, value)


def resolve(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [resolve(v, env) for v in node]
    if isinstance(node, dict):
        return {k: resolve(v, env) for k, v in node.items()}
    return node


def raw_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    return resolve(raw_compose(), env or {})


def variables_with_defaults(text: str) -> dict[str, str]:
    """Every ``${NAME:-default}`` in a text; a variable without a default fails the test."""
    found: dict[str, str] = {}
    for m in _VAR.finditer(text):
        if m.group("escaped"):
            continue
        assert m.group("braced") is not None, f"{m.group(0)}: use ${{NAME:-default}}"
        b = _BRACED.match(m.group("braced"))
        assert b and b.group("op") == ":-", f"{m.group(0)} has no default (write ${{NAME:-default}})"
        name, default = b.group("name"), b.group("arg")
        assert found.setdefault(name, default) == default, f"{name} has two different defaults"
    return found


def _size_bytes(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(text).strip().lower())
    assert m, f"cannot read size {text!r}"
    return int(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2)]


def _mounts(service: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Volume mounts by container path, long or short syntax, with read_only normalized."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, str):
            parts = v.split(":")
            v = {"type": "bind", "source": parts[0], "target": parts[1], "read_only": "ro" in parts[2:]}
        out[v["target"]] = {**v, "read_only": bool(v.get("read_only", False))}
    return out


def _secret_names(service: Mapping[str, Any]) -> set[str]:
    return {s if isinstance(s, str) else s["source"] for s in service.get("secrets", [])}


def _container_ports(service: Mapping[str, Any]) -> dict[int, str]:
    out = {}
    for p in service.get("ports", []):
        if isinstance(p, dict):
            out[int(p["target"])] = f"{p.get('host_ip', '')}:{p.get('published')}"
        else:
            host, _, container = str(p).rpartition(":")
            out[int(container.split("/")[0])] = host
    return out


# --------------------------------------------------------------------------- Dockerfiles


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.rstrip()
        if line.lstrip().startswith("#"):
            continue  # a comment, also inside a continued instruction
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            lines.append(current.strip())
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def base_image(path: Path, build_args: Mapping[str, str]) -> str:
    """The FROM image after ARG defaults and build args are applied, as docker build does."""
    args: dict[str, str] = {}
    for instr, rest in dockerfile_instructions(path):
        if instr == "ARG":
            name, _, default = rest.partition("=")
            args[name] = build_args.get(name, default)
        if instr == "FROM":
            return interpolate(rest.split()[0], args)
    raise AssertionError(f"{path} has no FROM")


def arg_defaults(path: Path) -> dict[str, str]:
    return {n: d for instr, rest in dockerfile_instructions(path) if instr == "ARG"
            for n, _, d in [rest.partition("=")]}


# --------------------------------------------------------------------------- the services


def test_services_and_profiles() -> None:
    c = compose()
    assert set(c["services"]) == {"factory", "triton"}
    # The factory runs once (`docker compose run --rm factory`); `up` starts only triton.
    assert c["services"]["factory"]["profiles"] == ["factory"]
    assert "profiles" not in c["services"]["triton"]


def test_every_variable_has_a_default_so_no_env_file_is_needed() -> None:
    defaults = variables_with_defaults(COMPOSE.read_text())
    assert {"REGISTRY", "TRT_TAG", "TRITON_TAG"} <= set(defaults)
    assert defaults["REGISTRY"] == "nvcr.io"
    assert re.fullmatch(r"\d\d\.\d\d", defaults["TRT_TAG"])
    # Engines run only on the TensorRT that built them: both images must be of one release.
    assert defaults["TRT_TAG"] == defaults["TRITON_TAG"]


def test_env_example_lists_every_variable_with_its_default() -> None:
    defaults = variables_with_defaults(COMPOSE.read_text())
    example = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            example[name.strip()] = value.strip()
    assert set(example) == set(defaults), "docker-compose.yml and .env.example name different variables"
    for name, default in defaults.items():
        assert example[name] == default, f"{name}: .env.example says {example[name]!r}, compose {default!r}"


@pytest.mark.parametrize("service, dockerfile, tag_var, image", [
    ("factory", FACTORY_DOCKERFILE, "TRT_TAG", "nvidia/tensorrt"),
    ("triton", TRITON_DOCKERFILE, "TRITON_TAG", "nvidia/tritonserver"),
])
def test_base_images_come_from_the_registry_variables(service, dockerfile, tag_var, image) -> None:
    for env, registry, tag in [({}, "nvcr.io", "25.10"),
                               ({"REGISTRY": "registry.example.internal/nvcr", tag_var: "26.01"},
                                "registry.example.internal/nvcr", "26.01")]:
        build = compose(env)["services"][service]["build"]
        assert build["context"] == "."
        assert build["dockerfile"] == f"docker/{dockerfile.name}"
        assert base_image(ROOT / build["dockerfile"], build["args"]) == f"{registry}/{image}:{tag}-py3"
    # A plain `docker build` (no compose) gives the same image as compose's defaults.
    defaults = compose()["services"][service]["build"]["args"]
    dockerfile_defaults = arg_defaults(dockerfile)
    for name, value in defaults.items():
        assert dockerfile_defaults.get(name) == value, f"{dockerfile.name}: ARG {name} default differs from compose"


def test_factory_has_no_network_and_the_signing_key() -> None:
    f = compose()["services"]["factory"]
    assert f["network_mode"] == "none"
    assert "ports" not in f and "networks" not in f
    assert _secret_names(f) == {"signing_key"}
    mounts = _mounts(f)
    assert mounts["/workspace/recipes"]["read_only"] is True
    assert mounts["/workspace/recipes"]["source"] == "./recipes"
    assert mounts["/workspace/model_repository"]["read_only"] is False
    assert mounts["/workspace/model_repository"]["source"] == "./model_repository"
    # Intermediates go to <repository>/../build/<model> (Recipe.work_dir): that must be a mount too.
    build_dir = str(PurePosixPath("/workspace/model_repository").parent / "build")
    assert mounts[build_dir]["read_only"] is False
    assert f["environment"]["HF_HUB_OFFLINE"] == "1"


def test_triton_serves_the_repository_read_only_with_the_policy_and_not_the_key() -> None:
    c = compose()
    t = c["services"]["triton"]
    assert t["command"] == SERVE_COMMAND
    mounts = _mounts(t)
    assert set(mounts) == {"/models", "/run/secrets/trust"}
    assert all(m["read_only"] for m in mounts.values())
    # The policy's relative paths resolve against its own folder: /run/secrets.
    assert mounts["/run/secrets/trust"]["source"] == "./keys/trust"
    # What the factory writes is what triton serves.
    assert mounts["/models"]["source"] == _mounts(c["services"]["factory"])["/workspace/model_repository"]["source"]
    assert _secret_names(t) == {"trust_policy"}, "the serving container must never see the private key"
    assert "network_mode" not in t


def test_secrets_are_files_named_by_variables() -> None:
    raw = raw_compose()["secrets"]
    assert raw["signing_key"]["file"] == "${SIGNING_KEY_FILE:-./keys/signing-key.pem}"
    assert raw["trust_policy"]["file"] == "${TRUST_POLICY_FILE:-./keys/policy.toml}"
    # /run/secrets/<name> is where compose mounts them (read-only); the commands rely on it.
    assert "/run/secrets/trust_policy" in SERVE_COMMAND
    assert "${FACTORY_SIGNING_KEY:-/run/secrets/signing_key}" in ENTRYPOINT.read_text()


def test_triton_ports() -> None:
    t = compose()["services"]["triton"]
    assert _container_ports(t) == {8000: "0.0.0.0:8000", 8001: "0.0.0.0:8001", 8002: "0.0.0.0:8002",
                                   9000: "0.0.0.0:9000"}
    moved = compose({"TRITON_BIND": "127.0.0.1", "TRITON_HTTP_PORT": "18000", "OPENAI_PORT": "19000"})["services"]["triton"]
    assert _container_ports(moved)[8000] == "127.0.0.1:18000" and _container_ports(moved)[9000] == "127.0.0.1:19000"
    # The OpenAI API (text-generation models) listens where the published port points.
    command = t["command"]
    assert command[command.index("--openai-port") + 1] == "9000"


@pytest.mark.parametrize("service", ["factory", "triton"])
def test_gpu_is_reserved(service) -> None:
    devices = compose()["services"][service]["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    assert devices[0]["driver"] == "nvidia"
    assert devices[0]["capabilities"] == ["gpu"]
    assert devices[0]["device_ids"] == ["0"]
    assert compose({"GPU_DEVICE": "GPU-abc"})["services"][service]["deploy"]["resources"]["reservations"][
        "devices"][0]["device_ids"] == ["GPU-abc"]


def test_triton_shared_memory_and_limits() -> None:
    t = compose()["services"]["triton"]
    assert _size_bytes(t["shm_size"]) >= 256 * 2**20
    assert t["ulimits"]["memlock"] == -1


def test_triton_health_check_asks_triton_if_it_is_ready() -> None:
    hc = compose()["services"]["triton"]["healthcheck"]
    test = hc["test"]
    assert test[0] == "CMD" and test[1] == "curl"
    assert "-f" in test[2] or "--fail" in test  # a 4xx/5xx must count as unhealthy
    assert test[-1] == "http://127.0.0.1:8000/v2/health/ready"
    assert "start_period" in hc and "interval" in hc and int(hc["retries"]) >= 1


def test_commands_use_options_the_cli_really_has() -> None:
    """The compose command and the entrypoint's build call against the click commands themselves."""
    pytest.importorskip("click")
    factory_cli = pytest.importorskip("model_factory.cli.factory")
    serve_opts = {o for p in factory_cli.serve.params for o in p.opts}
    assert {a for a in SERVE_COMMAND[2:] if a.startswith("--")} <= serve_opts
    build_opts = {o for p in factory_cli.build.params for o in p.opts}
    code = "\n".join(line for line in ENTRYPOINT.read_text().splitlines() if not line.lstrip().startswith("#"))
    assert "model-factory build" in code
    used = set(re.findall(r"\s(--[a-z][a-z-]+)", code))  # every option in the script goes to build
    assert {"--repository", "--key", "--cert-chain"} <= used <= build_opts


def test_entrypoint_paths_match_the_mounts() -> None:
    text = ENTRYPOINT.read_text()
    mounts = _mounts(compose()["services"]["factory"])
    for var, target in [("FACTORY_RECIPES_DIR", "/workspace/recipes"),
                        ("FACTORY_REPOSITORY", "/workspace/model_repository")]:
        assert f"${{{var}:-{target}}}" in text
        assert target in mounts


# --------------------------------------------------------------------------- Dockerfiles


@pytest.mark.parametrize("dockerfile", [FACTORY_DOCKERFILE, TRITON_DOCKERFILE])
def test_dockerfiles_install_only_from_the_wheelhouse(dockerfile) -> None:
    text = dockerfile.read_text()
    instructions = dockerfile_instructions(dockerfile)
    runs = [rest for instr, rest in instructions if instr == "RUN"]
    pip_installs = [r for r in runs if "pip install" in r]
    assert pip_installs, "no pip install"
    for r in pip_installs:
        assert "--no-index" in r and "--find-links /tmp/wheelhouse" in r
        assert "source=wheelhouse" in r  # the wheels are mounted from the build context
        assert "sha256sum --check --strict --quiet SHA256SUMS" in r
        assert "m['target']['python_version'] or m['built_with']['python']" in r  # the wheelhouse was built for this image's Python
    copies = [rest for instr, rest in instructions if instr == "COPY"]
    assert any("wheelhouse/manifest.json" in c and "wheelhouse/SHA256SUMS" in c for c in copies)
    # An air-gapped builder cannot pull a Dockerfile frontend image.
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    assert not any(i == "ADD" for i, _ in instructions), "ADD can fetch URLs; use COPY"


@pytest.mark.parametrize("dockerfile", [FACTORY_DOCKERFILE, TRITON_DOCKERFILE])
def test_dockerignore_sends_what_the_dockerfile_uses(dockerfile) -> None:
    ignore = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    rules = [r.strip() for r in ignore if r.strip() and not r.startswith("#")]
    assert rules[0] == "*", "start from nothing, then allow"
    allowed = [r[1:].rstrip("/") for r in rules[1:] if r.startswith("!")]
    used = ["wheelhouse"]
    for instr, rest in dockerfile_instructions(dockerfile):
        if instr == "COPY":
            used += [s for s in rest.split()[:-1] if not s.startswith("--")]
    for src in used:
        assert any(src.rstrip("/") == a or src.startswith(a + "/") for a in allowed), f"{src} is not sent"
        assert (ROOT / src).exists() or src.startswith("wheelhouse"), f"{src} does not exist"


def test_triton_image_checks_what_the_service_needs() -> None:
    runs = " ".join(rest for instr, rest in dockerfile_instructions(TRITON_DOCKERFILE) if instr == "RUN")
    assert "command -v curl" in runs  # the health check
    assert "command -v tritonserver" in runs  # serve starts the one on PATH
    assert "numpy.__version__.startswith('1.')" in runs
    cmd = next(rest for instr, rest in dockerfile_instructions(TRITON_DOCKERFILE) if instr == "CMD")
    assert yaml.safe_load(cmd) == SERVE_COMMAND


def test_factory_image_runs_the_entrypoint() -> None:
    instructions = dockerfile_instructions(FACTORY_DOCKERFILE)
    assert any(i == "COPY" and "docker/factory-entrypoint.sh /usr/local/bin/factory-entrypoint" in r
               for i, r in instructions)
    cmd = next(rest for instr, rest in instructions if instr == "CMD")
    assert yaml.safe_load(cmd) == compose()["services"]["factory"]["command"] == ["factory-entrypoint"]


# --------------------------------------------------------------------------- external validators


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    v1 = shutil.which("docker-compose")
    return [v1] if v1 else None


def test_compose_config_accepts_the_file(tmp_path) -> None:
    """`docker compose config` parses, validates and interpolates without an engine."""
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither the docker compose plugin nor docker-compose is installed")
    empty_env = tmp_path / "empty.env"
    empty_env.write_text("")
    base = [*cli, "--project-directory", str(ROOT), "-f", str(COMPOSE), "--env-file", str(empty_env),
            "--profile", "factory", "config"]
    clean = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(base, capture_output=True, text=True, cwd=tmp_path, env=clean, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    f, t = cfg["services"]["factory"], cfg["services"]["triton"]
    assert f["network_mode"] == "none"
    assert f["build"]["args"]["REGISTRY"] == "nvcr.io"
    assert t["command"] == SERVE_COMMAND
    assert _mounts(t)["/models"]["read_only"] is True
    assert t["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    mirrored = subprocess.run(base, capture_output=True, text=True, cwd=tmp_path, timeout=60,
                              env={**clean, "REGISTRY": "mirror.internal:5000", "TRITON_TAG": "25.11"})
    assert mirrored.returncode == 0, mirrored.stderr
    args = yaml.safe_load(mirrored.stdout)["services"]["triton"]["build"]["args"]
    assert args["REGISTRY"] == "mirror.internal:5000" and str(args["TRITON_TAG"]) == "25.11"


def test_compose_file_matches_the_compose_spec_schema() -> None:
    check_jsonschema("vendor.compose-spec", COMPOSE)


def test_triton_image_carries_a_gpu_engine_matching_its_tensorrt() -> None:
    """The default serving image installs TensorRT's bindings and fails its build if they do not load there."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["tensorrt"] == ["tensorrt-cu13-bindings==11.4.0.106"]
    instructions = dockerfile_instructions(TRITON_DOCKERFILE)
    default = next(rest for instr, rest in instructions if instr == "ARG" and rest.startswith("TRITON_EXTRAS="))
    assert "tensorrt" in default.split("=", 1)[1].split(",")
    args = compose()["services"]["triton"]["build"]["args"]
    assert "tensorrt" in args["TRITON_EXTRAS"].split(",")
    assert "TRITON_EXTRAS=serve,sign,gpu,tensorrt" in ENV_EXAMPLE.read_text().splitlines()
    runs = " ".join(rest for instr, rest in instructions if instr == "RUN")
    # Imported at build time: the bindings need the image's own libnvinfer; TensorRT-RTX would not do on a datacenter GPU.
    assert "import_tensorrt" in runs and "m.__name__ != 'tensorrt_rtx'" in runs
    # The onnxruntime-gpu extras exist and are kept apart from the CPU wheel's.
    assert not any(r.startswith("onnxruntime>") for r in extras["serve-gpu"] + extras["onnxruntime-gpu"])
    assert any(r.startswith("onnxruntime-gpu") for r in extras["serve-gpu"])
