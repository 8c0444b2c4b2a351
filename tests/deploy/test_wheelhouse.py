"""model_factory.distribution.wheelhouse and the ``wheelhouse`` command.

The fast tests work on hand-made wheels. The slow ones build real wheelhouses
(they need the package index, as building one always does) and then install
from one into a fresh virtualenv with no index, no pip configuration and, where
network namespaces work, no network at all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from model_factory.errors import FactoryError
from model_factory.distribution.wheelhouse import (MANIFEST, REQUIREMENTS, SHA256SUMS, _write_index, build_wheelhouse,
                                      canonical_name, check_wheelhouse, closure_gaps, parse_wheel_filename,
                                      target_environment, target_platforms)

from .netns import netns_available, run_in_netns

ROOT = Path(__file__).resolve().parents[2]


def make_wheel(folder: Path, name: str, version: str, requires: list[str] = (), tag: str = "py3-none-any") -> Path:
    """A minimal valid wheel: just METADATA (enough for indexing and the closure check)."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-{tag}.whl"
    meta = "Metadata-Version: 2.1\n" f"Name: {name}\n" f"Version: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{dist}.dist-info/METADATA", meta)
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")
    return path


def fake_wheelhouse(folder: Path) -> Path:
    folder.mkdir()
    make_wheel(folder, "model-factory", "0.1.0", ["click>=8.1"])
    make_wheel(folder, "click", "8.1.7")
    _write_index(folder, project_version="0.1.0", extras=(), packages=(), python_version=None, platforms=())
    return folder


# --------------------------------------------------------------------------- helpers


def test_manylinux_platforms_expand_to_older_glibc_levels() -> None:
    tags = target_platforms("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64"
    assert "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert "manylinux_2_29_x86_64" not in tags and "manylinux_2_16_x86_64" not in tags
    assert all(t.endswith("x86_64") for t in tags)
    legacy = target_platforms("manylinux2014_aarch64")
    assert legacy[0] == "manylinux_2_17_aarch64" and "manylinux2014_aarch64" in legacy
    # Wheels for an older glibc run on a newer one: the legacy 2010 (2.12) and 1 (2.5) tags are kept.
    assert {"manylinux2010_aarch64", "manylinux1_aarch64"} <= set(legacy)
    assert "manylinux2010_x86_64" in tags
    assert target_platforms("win_amd64") == ("win_amd64",)
    assert target_platforms(None) == ()
    with pytest.raises(FactoryError, match="not a wheel platform tag"):
        target_platforms("Linux x86-64")


def test_wheel_filenames() -> None:
    assert parse_wheel_filename("model_factory-0.1.0-py3-none-any.whl") == ("model-factory", "0.1.0")
    assert parse_wheel_filename("Markdown_It_Py-4.0.0-1-py3-none-any.whl") == ("markdown-it-py", "4.0.0")
    assert canonical_name("ruamel.yaml") == "ruamel-yaml"
    with pytest.raises(FactoryError):
        parse_wheel_filename("pkg-1.0.tar.gz")
    with pytest.raises(FactoryError):
        parse_wheel_filename("pkg-1.0.whl")


def test_target_environment() -> None:
    env = target_environment("3.10", target_platforms("manylinux_2_28_aarch64"))
    assert env["python_version"] == "3.10" and env["python_full_version"] == "3.10.0"
    assert env["platform_machine"] == "aarch64" and env["sys_platform"] == "linux"
    assert env["implementation_name"] == "cpython"
    assert target_environment(None, ())["python_version"] == f"{sys.version_info[0]}.{sys.version_info[1]}"


def test_closure_finds_what_the_target_needs_and_pip_skipped(tmp_path) -> None:
    """pip evaluates markers for the Python it runs under (pypa/pip#11010); the closure does not."""
    make_wheel(tmp_path, "model-factory", "0.1.0", ['tomli>=2.0; python_version < "3.11"', "client-lib[http]>=2",
                                                    'gpu-lib; extra == "gpu"'])
    make_wheel(tmp_path, "client-lib", "2.5", ['httpish; extra == "http"', 'grpcish; extra == "grpc"'])
    env310 = target_environment("3.10", ())
    missing, conflicts = closure_gaps(tmp_path, ["model-factory"], env310)
    assert missing == ["httpish", "tomli>=2.0"] and conflicts == []
    missing, _ = closure_gaps(tmp_path, ["model-factory[gpu]"], target_environment("3.12", ()))
    assert missing == ["gpu-lib", "httpish"]  # tomli is not needed on 3.12; the gpu extra is followed
    roots = ["model-factory", 'only-old; python_version < "3.11"']
    assert closure_gaps(tmp_path, roots, env310)[0] == ["httpish", "only-old", "tomli>=2.0"]
    assert "only-old" not in closure_gaps(tmp_path, roots, target_environment("3.12", ()))[0]


def test_closure_reports_version_conflicts(tmp_path) -> None:
    make_wheel(tmp_path, "model-factory", "0.1.0", ['numpy<2; python_version < "3.13"', 'numpy>=2; python_version >= "3.13"'])
    make_wheel(tmp_path, "numpy", "1.26.4", tag="cp312-cp312-manylinux_2_17_x86_64")
    assert closure_gaps(tmp_path, ["model-factory"], target_environment("3.12", ())) == ([], [])
    missing, conflicts = closure_gaps(tmp_path, ["model-factory"], target_environment("3.13", ()))
    assert missing == [] and conflicts == ["numpy 1.26.4 is in the wheelhouse, the target needs numpy>=2"]


# --------------------------------------------------------------------------- index and check


def test_index_files_pin_every_wheel(tmp_path) -> None:
    wh = fake_wheelhouse(tmp_path / "wh")
    manifest = json.loads((wh / MANIFEST).read_text())
    assert [w["name"] for w in manifest["wheels"]] == ["click", "model-factory"]
    reqs = [line for line in (wh / REQUIREMENTS).read_text().splitlines() if not line.startswith("#")]
    assert reqs == [f"click==8.1.7 --hash=sha256:{manifest['wheels'][0]['sha256']}",
                    f"model-factory==0.1.0 --hash=sha256:{manifest['wheels'][1]['sha256']}"]
    sums = (wh / SHA256SUMS).read_text().splitlines()
    assert sums == [f"{w['sha256']}  {w['file']}" for w in manifest["wheels"]]
    if shutil.which("sha256sum"):  # the exact check the Dockerfiles run
        subprocess.run(["sha256sum", "--check", "--strict", "--quiet", SHA256SUMS], cwd=wh, check=True)


def test_check_accepts_an_intact_wheelhouse(tmp_path) -> None:
    report = check_wheelhouse(fake_wheelhouse(tmp_path / "wh"))
    assert {w.name for w in report.wheels} == {"click", "model-factory"}
    assert report.project_version == "0.1.0"


@pytest.mark.parametrize("damage, message", [
    (lambda wh: (wh / "click-8.1.7-py3-none-any.whl").write_bytes(b"tampered"), "sha256 mismatch: click"),
    (lambda wh: (wh / "click-8.1.7-py3-none-any.whl").unlink(), "missing: click"),
    (lambda wh: make_wheel(wh, "extra", "1.0"), "not in the manifest: extra-1.0"),
    (lambda wh: (wh / MANIFEST).write_text("{"), "damaged"),
    (lambda wh: (wh / MANIFEST).unlink(), "not a model-factory wheelhouse"),
])
def test_check_names_each_problem(tmp_path, damage, message) -> None:
    wh = fake_wheelhouse(tmp_path / "wh")
    damage(wh)
    with pytest.raises(FactoryError, match=message):
        check_wheelhouse(wh)


def test_index_refuses_non_wheels(tmp_path) -> None:
    folder = tmp_path / "wh"
    folder.mkdir()
    make_wheel(folder, "model-factory", "0.1.0")
    (folder / "foo-1.0.tar.gz").write_bytes(b"")
    with pytest.raises(FactoryError, match="not a wheel"):
        _write_index(folder, project_version="0.1.0", extras=(), packages=(), python_version=None, platforms=())


# --------------------------------------------------------------------------- argument checks (before any pip)


@pytest.mark.parametrize("kwargs, message", [
    ({"extras": ["serve,nope"]}, "unknown extra 'nope'"),
    ({"python_version": "312"}, "not of the form 3.X"),
    ({"python_version": "2.7"}, "not of the form 3.X"),
    ({"platform": "linux x86"}, "not a wheel platform tag"),
    ({"constraints": Path("/nonexistent/constraints.txt")}, "does not exist"),
])
def test_bad_arguments_fail_before_pip_runs(tmp_path, monkeypatch, kwargs, message) -> None:
    monkeypatch.setattr("model_factory.distribution.wheelhouse._pip", lambda *a, **k: pytest.fail("pip ran"))
    args = {"extras": [], "python_version": None, "platform": None, **kwargs}
    extra = {"constraints": args.pop("constraints")} if "constraints" in args else {}
    with pytest.raises(FactoryError, match=message):
        build_wheelhouse(tmp_path / "wh", args["extras"], args["python_version"], args["platform"], ROOT, **extra)
    assert not (tmp_path / "wh").exists()


def test_refuses_a_non_empty_destination_without_force(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("model_factory.distribution.wheelhouse._pip", lambda *a, **k: pytest.fail("pip ran"))
    dest = tmp_path / "wh"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(FactoryError, match="pass --force"):
        build_wheelhouse(dest, [], None, None, ROOT)
    assert (dest / "keep.txt").read_text() == "mine"


def test_refuses_a_project_that_is_not_model_factory(tmp_path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "pyproject.toml").write_text('[project]\nname = "something-else"\nversion = "1"\n')
    with pytest.raises(FactoryError, match="not model-factory"):
        build_wheelhouse(tmp_path / "wh", [], None, None, other)
    with pytest.raises(FactoryError, match="no pyproject.toml"):
        build_wheelhouse(tmp_path / "wh", [], None, None, tmp_path)


def test_failed_pip_leaves_nothing_behind(tmp_path, monkeypatch) -> None:
    def failing_pip(args, echo, what):
        raise FactoryError(f"{what} failed")
    monkeypatch.setattr("model_factory.distribution.wheelhouse._pip", failing_pip)
    with pytest.raises(FactoryError, match="failed"):
        build_wheelhouse(tmp_path / "wh", [], None, None, ROOT)
    assert list(tmp_path.iterdir()) == []  # no dest, no temporary folder


def test_source_copy_leaves_out_environments_and_outputs(tmp_path, monkeypatch) -> None:
    """The project wheel is built from a copy without .venv, build/, wheelhouse/, the destination."""
    seen = {}

    def fake_pip(args, echo, what):
        if args[0] == "wheel" and "--no-deps" in args:
            src = Path(args[-1])
            seen["top"] = sorted(p.name for p in src.iterdir())
            seen["pycache"] = list(src.rglob("__pycache__"))
            raise FactoryError("stop here")
    monkeypatch.setattr("model_factory.distribution.wheelhouse._pip", fake_pip)
    project = tmp_path / "project"
    for folder in ("model_factory/__pycache__", ".venv/lib", "build/x", "wheelhouse", "model_repository/m", ".git"):
        (project / folder).mkdir(parents=True)
    (project / "pyproject.toml").write_text('[project]\nname = "model-factory"\nversion = "0.1.0"\n')
    (project / "model_factory" / "__init__.py").write_text("")
    with pytest.raises(FactoryError, match="stop here"):
        build_wheelhouse(project / "dist-offline", [], None, None, project)
    assert seen["top"] == ["model_factory", "pyproject.toml"]
    assert seen["pycache"] == []


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_source_copy_of_a_git_checkout_follows_gitignore(tmp_path, monkeypatch) -> None:
    seen = {}

    def fake_pip(args, echo, what):
        src = Path(args[-1])
        seen["files"] = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
        raise FactoryError("stop here")
    monkeypatch.setattr("model_factory.distribution.wheelhouse._pip", fake_pip)
    project = tmp_path / "project"
    (project / "model_factory").mkdir(parents=True)
    (project / "pyproject.toml").write_text('[project]\nname = "model-factory"\nversion = "0.1.0"\n')
    (project / "model_factory" / "__init__.py").write_text("")
    (project / "model_factory" / "new_module.py").write_text("")  # untracked, not ignored: included
    (project / ".gitignore").write_text("/.cache/\n*.bin\n")
    (project / ".cache").mkdir()
    (project / ".cache" / "huge.whl").write_text("")
    (project / "model_factory" / "weights.bin").write_text("")
    (project / "gone.py").write_text("")
    git = ["git", "-C", str(project), "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "pyproject.toml", "model_factory/__init__.py", ".gitignore", "gone.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    (project / "gone.py").unlink()  # tracked but deleted in the work tree
    with pytest.raises(FactoryError, match="stop here"):
        build_wheelhouse(project / "wheelhouse", [], None, None, project)
    assert seen["files"] == [".gitignore", "model_factory/__init__.py", "model_factory/new_module.py",
                             "pyproject.toml"]


# --------------------------------------------------------------------------- the command


def test_cli_check_and_errors(tmp_path) -> None:
    from model_factory.cli.wheelhouse import wheelhouse

    wh = fake_wheelhouse(tmp_path / "wh")
    runner = CliRunner()
    ok = runner.invoke(wheelhouse, [str(wh), "--check"])
    assert ok.exit_code == 0, ok.output
    assert "2 wheels match the manifest" in ok.output
    (wh / "click-8.1.7-py3-none-any.whl").write_bytes(b"x")
    bad = runner.invoke(wheelhouse, [str(wh), "--check"])
    assert bad.exit_code == 1 and "sha256 mismatch: click" in bad.output and "Traceback" not in bad.output
    unknown = runner.invoke(wheelhouse, [str(tmp_path / "new"), "--extras", "nope", "--project-dir", str(ROOT)])
    assert unknown.exit_code == 1 and "unknown extra 'nope'" in unknown.output


def test_cli_has_help_with_examples() -> None:
    from model_factory.cli.wheelhouse import wheelhouse

    out = CliRunner().invoke(wheelhouse, ["--help"]).output
    assert "--no-index" in out and "--python-version 3.12" in out


# --------------------------------------------------------------------------- real builds (need the index)


def _offline_env(home: Path) -> dict[str, str]:
    """No pip configuration at all: no index, no find-links, no constraints from this machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", HOME=str(home))
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture(scope="module")
def native_wheelhouse(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("native") / "wheelhouse"
    build_wheelhouse(dest, [], None, None, ROOT)
    return dest


@pytest.mark.slow
def test_native_wheelhouse_installs_with_no_index_and_no_network(native_wheelhouse, tmp_path) -> None:
    report = check_wheelhouse(native_wheelhouse)
    names = {w.name for w in report.wheels}
    assert {"model-factory", "click", "numpy", "cryptography", "protobuf", "rich"} <= names
    assert oct(native_wheelhouse.stat().st_mode & 0o777) == "0o755"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index",
               "--find-links", str(native_wheelhouse), "model-factory"]
    env = _offline_env(tmp_path)
    if netns_available()[0]:
        proc = run_in_netns(install, env=env, cwd=tmp_path, timeout=300)
    else:  # still no index and no configuration; only the namespace fence is missing
        proc = subprocess.run(install, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    probe = subprocess.run([str(py), "-c", "import model_factory, numpy, sys; "
                            "print(model_factory.__file__); print(numpy.__version__)"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    module_file, numpy_version = probe.stdout.split()
    assert module_file.startswith(str(venv)), "imported the checkout, not the installed wheel"
    assert numpy_version.startswith("1.")
    cli = subprocess.run([str(venv / "bin" / "model-factory"), "--help"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert "wheelhouse" in cli.stdout


@pytest.mark.slow
def test_hash_pinned_install_from_requirements(native_wheelhouse, tmp_path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                           "--no-index", "--find-links", str(native_wheelhouse), "--require-hashes",
                           "-r", str(native_wheelhouse / REQUIREMENTS), "--dry-run"],
                          env=_offline_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Would install" in proc.stdout and "model-factory-0.1.0" in proc.stdout


@pytest.mark.slow
def test_cross_target_wheelhouse_has_the_targets_wheels_and_markers(tmp_path) -> None:
    """Python 3.10 on manylinux_2_28: cp310 binaries, plus what only 3.10 needs (tomli)."""
    report = build_wheelhouse(tmp_path / "wh310", [], "3.10", "manylinux_2_28_x86_64", ROOT)
    names = {w.name for w in report.wheels}
    assert "tomli" in names  # model-factory: tomli; python_version < '3.11' (pip alone skips it here)
    assert report.platforms[0] == "manylinux_2_28_x86_64" and report.python_version == "3.10"
    for w in report.wheels:
        _, _, py, abi, plat = w.filename[:-4].rsplit("-", 4)
        assert plat == "any" or "x86_64" in plat, w.filename
        assert abi in ("none", "abi3", "cp310"), w.filename
        if abi != "none":
            glibc = [int(t.split("_")[2]) for t in plat.split(".") if t.startswith("manylinux_2_")]
            assert not glibc or min(glibc) <= 28, w.filename
    manifest = json.loads((tmp_path / "wh310" / MANIFEST).read_text())
    assert manifest["target"]["python_version"] == "3.10"


def test_refuses_a_wheelhouse_with_both_onnxruntime_wheels(tmp_path, monkeypatch) -> None:
    """onnxruntime and onnxruntime-gpu install the same package: one environment must never get both."""
    def fake_pip(args, echo, what):
        folder = Path(args[args.index("--wheel-dir") + 1])
        folder.mkdir(parents=True, exist_ok=True)
        if "--no-deps" in args:  # our own wheel
            make_wheel(folder, "model-factory", "0.1.0", ["onnxruntime", "onnxruntime-gpu"])
        else:
            make_wheel(folder, "onnxruntime", "1.32.0")
            make_wheel(folder, "onnxruntime-gpu", "1.31.1")
    monkeypatch.setattr("model_factory.distribution.wheelhouse._pip", fake_pip)
    with pytest.raises(FactoryError, match=r"extras serve,onnxruntime-gpu: both onnxruntime \(CPU\) and "
                                           r"onnxruntime-gpu are present.*Fix: keep one"):
        build_wheelhouse(tmp_path / "wh", ["serve,onnxruntime-gpu"], None, None, ROOT)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_installed_onnxruntime_wheels_are_checked(monkeypatch) -> None:
    import importlib.metadata as md

    from model_factory.backend.engines import onnxruntime as ort_engine

    monkeypatch.setattr(md, "version", lambda name: "1.0")  # both distributions "installed"
    clash = ort_engine.installed_onnxruntime_conflict()
    assert clash and "overwrite each other's files" in clash
    assert ort_engine.cuda_provider_unavailable_reason() == clash  # named before anything else
    assert ort_engine.onnxruntime_conflict(["onnxruntime_gpu", "numpy"]) is None
