"""Offline installs: a wheelhouse built on a connected machine, installed with ``--no-index``.

A wheelhouse is a folder of wheels that holds model-factory itself and every
dependency of the extras asked for, built or downloaded for one target (a
Python version and a platform), plus three index files:

* ``requirements.txt``: ``name==version --hash=sha256:...`` for every wheel, so
  ``pip install --no-index --find-links DIR --require-hashes -r DIR/requirements.txt``
  installs exactly what was built;
* ``SHA256SUMS``: the same digests in ``sha256sum --check`` format, for the
  Dockerfiles and for checking a copy after it was carried into the network;
* ``manifest.json``: what was asked for (extras, target) and what came out.

The digests prove a copy is intact, not who made it: sign ``SHA256SUMS`` with
the customer's own tooling if the transfer path needs that.

Two modes:

* native (no ``python_version``, no ``platform``): ``pip wheel`` resolves for
  the running interpreter and builds a wheel from any dependency that only
  ships an sdist, so the offline install never needs a compiler or setuptools;
* cross (``python_version`` and/or ``platform`` given): ``pip download
  --only-binary=:all:`` for that target, since sdists cannot be built for
  another interpreter here.

pip evaluates environment markers (``tomli; python_version < "3.11"``) for the
interpreter it runs under, not for ``--python-version`` (pypa/pip#11010). So
after the download every wheel's ``Requires-Dist`` is evaluated again for the
target, and whatever the target needs but pip skipped is downloaded in a
further pass; a version the target needs that conflicts with one already
chosen is an error that says to build with a Python of the target's version.

The project's own wheel is always built with ``pip wheel --no-deps`` from a
copy of the source tree (so the checkout gets no ``build/`` or ``*.egg-info``),
and the dependencies are resolved from that wheel file, never from an index:
PyPI has an unrelated project also called ``model-factory``.

Everything is written into a temporary folder beside ``dest`` and renamed into
place once complete, so a failed or interrupted build leaves no half wheelhouse.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from email.parser import HeaderParser
from typing import Any, Sequence

from model_factory.errors import FactoryError
from model_factory.fileio import digest_path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

PROJECT_NAME = "model-factory"
MANIFEST = "manifest.json"
REQUIREMENTS = "requirements.txt"
SHA256SUMS = "SHA256SUMS"
MANIFEST_FORMAT = 1

_PY_VERSION_RE = re.compile(r"^3(\.\d{1,2})?$")
_PLATFORM_RE = re.compile(r"^[a-z0-9_]+$")
_MANYLINUX_RE = re.compile(r"^manylinux_2_(\d+)_([a-z0-9_]+)$")
_LEGACY_MANYLINUX = {"manylinux2014": 17, "manylinux2010": 12, "manylinux1": 5}
# Top-level folders of a checkout that are never part of the package source.
_SKIP_TOP = {".git", ".venv", "venv", "build", "dist", "wheelhouse", "model_repository",
             ".pytest_cache", ".mypy_cache", ".ruff_cache", "node_modules"}
_SKIP_ANYWHERE = ("__pycache__", ".egg-info", ".pyc", ".onnx", ".plan", ".engine")


@dataclass(frozen=True)
class WheelEntry:
    """One wheel in a wheelhouse."""

    filename: str
    name: str  # canonical project name (PEP 503)
    version: str
    sha256: str
    size: int


@dataclass(frozen=True)
class WheelhouseReport:
    """What a wheelhouse holds and which target it was built for."""

    path: Path
    project_version: str
    extras: tuple[str, ...]
    packages: tuple[str, ...]
    python_version: str | None
    platforms: tuple[str, ...]
    wheels: tuple[WheelEntry, ...]

    @property
    def requirements_file(self) -> Path:
        return self.path / REQUIREMENTS

    @property
    def manifest_file(self) -> Path:
        return self.path / MANIFEST

    @property
    def total_bytes(self) -> int:
        return sum(w.size for w in self.wheels)

    def install_command(self, python: str = "python3") -> str:
        """The offline install line for this wheelhouse, as a user would type it."""
        extras = f"[{','.join(self.extras)}]" if self.extras else ""
        return (f"{python} -m pip install --no-index --find-links {self.path} "
                f"'{PROJECT_NAME}{extras}=={self.project_version}'")


# --------------------------------------------------------------------------- small helpers


def canonical_name(name: str) -> str:
    """PEP 503 normalized project name (``packaging.utils.canonicalize_name``)."""
    from packaging.utils import canonicalize_name

    return str(canonicalize_name(name))


def parse_wheel_filename(filename: str) -> tuple[str, str]:
    """Return ``(canonical name, version)`` of a wheel file name (PEP 427, read by ``packaging``)."""
    from packaging.utils import InvalidWheelFilename
    from packaging.utils import parse_wheel_filename as parse

    if not filename.endswith(".whl"):
        raise FactoryError(f"{filename} is not a wheel (.whl). Fix: keep only wheels in a wheelhouse")
    try:
        name, version, _build, _tags = parse(filename)
    except (InvalidWheelFilename, ValueError) as exc:
        raise FactoryError(f"{filename} is not a valid wheel file name (name-version[-build]-py-abi-platform.whl): "
                           f"{exc}. Fix: keep only wheels as pip names them in a wheelhouse") from None
    return str(name), str(version)


def target_platforms(platform: str | None) -> tuple[str, ...]:
    """The ``--platform`` tags pip should accept for a target platform.

    pip matches ``--platform`` literally, so ``manylinux_2_28_x86_64`` alone
    would miss the many wheels tagged ``manylinux_2_17_x86_64`` that also run
    there. A ``manylinux_2_Y`` (or legacy ``manylinux2014``) tag is expanded to
    every older glibc level down to 2.17 (and the legacy aliases); any other
    tag is passed through as it is.
    """
    if platform is None:
        return ()
    if not _PLATFORM_RE.match(platform):
        raise FactoryError(f"platform {platform!r} is not a wheel platform tag. "
                           "Fix: use a tag such as manylinux_2_28_x86_64 or manylinux_2_39_aarch64")
    legacy, _, arch = platform.partition("_")
    if legacy in _LEGACY_MANYLINUX and arch:
        glibc_minor = _LEGACY_MANYLINUX[legacy]
    else:
        m = _MANYLINUX_RE.match(platform)
        if not m:
            return (platform,)
        glibc_minor, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc_minor, 16, -1)]
    for alias, minor in _LEGACY_MANYLINUX.items():
        if minor <= glibc_minor:
            tags.append(f"{alias}_{arch}")
    return tuple(dict.fromkeys(tags))


def _read_project(project_dir: Path) -> tuple[str, set[str]]:
    """Version and extras of the model-factory project at ``project_dir``."""
    pyproject = project_dir / "pyproject.toml"
    if not pyproject.is_file():
        raise FactoryError(f"{project_dir} has no pyproject.toml. Fix: pass --project-dir pointing at a "
                           "model-factory source checkout")
    try:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
    except tomllib.TOMLDecodeError as exc:
        raise FactoryError(f"{pyproject} is not valid TOML: {exc}") from exc
    name = project.get("name", "")
    if canonical_name(name) != PROJECT_NAME:
        raise FactoryError(f"{pyproject} is the project {name!r}, not {PROJECT_NAME}. "
                           "Fix: pass --project-dir pointing at the model-factory checkout")
    version = project.get("version")
    if not isinstance(version, str):
        raise FactoryError(f"{pyproject} has no static [project].version; the wheelhouse manifest needs one")
    return version, set(project.get("optional-dependencies", {}))


def _normalize_extras(extras: Sequence[str], known: set[str]) -> tuple[str, ...]:
    out: list[str] = []
    for item in extras:
        for extra in str(item).split(","):
            extra = extra.strip()
            if not extra:
                continue
            if extra not in known:
                raise FactoryError(f"unknown extra {extra!r}. Fix: use some of: {', '.join(sorted(known))}")
            if extra not in out:
                out.append(extra)
    return tuple(out)


def _normalize_python_version(python_version: str | None) -> str | None:
    if python_version is None:
        return None
    if not _PY_VERSION_RE.match(python_version):
        raise FactoryError(f"python version {python_version!r} is not of the form 3.X. "
                           "Fix: give the target's Python, e.g. --python-version 3.12")
    return python_version


def _git_files(root: Path) -> list[str] | None:
    """Files of a git checkout that are tracked or untracked-but-not-ignored; None if not a checkout."""
    if not (root / ".git").exists() or shutil.which("git") is None:
        return None
    proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          capture_output=True, check=False)
    if proc.returncode != 0:
        return None
    return [name for name in proc.stdout.decode("utf-8", "surrogateescape").split("\0") if name]


def _copy_source(project_dir: Path, into: Path, skip: Sequence[Path]) -> Path:
    """Copy the checkout without virtualenvs, build outputs and generated models.

    In a git checkout: the files git would commit (tracked, or untracked and not
    ignored), so the project's .gitignore decides. Otherwise the whole folder
    less the usual environments and outputs.
    """
    root = project_dir.resolve()
    skip_resolved = {p.resolve() for p in skip}
    dest = into / "src"

    def skipped(path: Path) -> bool:
        return path.name.endswith(_SKIP_ANYWHERE) or path in skip_resolved or any(
            parent in skip_resolved for parent in path.parents)

    files = _git_files(root)
    if files is not None:
        for name in files:
            src = root / name
            rel = Path(name)
            if rel.parts[0] in _SKIP_TOP or any(part.endswith(_SKIP_ANYWHERE) for part in rel.parts) \
                    or skipped(src) or not (src.is_file() or src.is_symlink()):
                continue  # deleted in the work tree, an output, or the destination itself
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target, follow_symlinks=False)
        return dest

    def ignore(folder: str, names: list[str]) -> set[str]:
        here = Path(folder).resolve()
        ignored = {n for n in names if skipped(here / n)}
        if here == root:
            ignored |= {n for n in names if n in _SKIP_TOP}
        return ignored

    shutil.copytree(root, dest, ignore=ignore, symlinks=True)
    return dest


def _pip(args: Sequence[str], echo: bool, what: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]
    try:
        if echo:
            proc = subprocess.run(cmd, check=False)
            tail = "(pip's output is above)"
        else:
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            tail = "\n".join(lines[-25:])
    except OSError as exc:  # the interpreter itself could not be started
        raise FactoryError(f"could not run pip ({exc}). Fix: run model-factory from a Python with pip") from exc
    if proc.returncode != 0:
        hint = ""
        m = re.search(r"No matching distribution found for (\S+)", tail)
        if m:
            hint = (f"\nFix: {m.group(1)} has no wheel for this target. Pin a version that has one "
                    "(--constraint), add an index that serves it (--pip-arg=--extra-index-url=...), "
                    "or build its wheel on a machine like the target and pass --pip-arg=--find-links=DIR.")
        elif "No module named pip" in tail:
            hint = f"\nFix: install pip into {sys.executable}'s environment (python -m ensurepip)."
        raise FactoryError(f"{what} failed (pip exited {proc.returncode}):\n{tail}\ncommand: {' '.join(cmd)}{hint}")


def _index(folder: Path) -> tuple[WheelEntry, ...]:
    entries = []
    for path in sorted(folder.iterdir()):
        if path.name in (MANIFEST, REQUIREMENTS, SHA256SUMS):
            continue
        if not path.is_file() or path.suffix != ".whl":
            raise FactoryError(f"{path.name} in the wheelhouse is not a wheel. Fix: remove it; an offline "
                               "install can only use wheels")
        name, version = parse_wheel_filename(path.name)
        entries.append(WheelEntry(path.name, name, version, digest_path(path), path.stat().st_size))
    return tuple(entries)


def _packaging() -> Any:
    """``packaging`` (PEP 508 markers and requirements): the installed one, else pip's own copy."""
    try:
        import packaging.markers
        import packaging.requirements
        import packaging.version

        return packaging
    except ImportError:  # pip is always there when a wheelhouse is built
        from pip._vendor import packaging  # type: ignore[no-redef]
        import pip._vendor.packaging.markers  # noqa: F401
        import pip._vendor.packaging.requirements  # noqa: F401
        import pip._vendor.packaging.version  # noqa: F401

        return packaging


def target_environment(python_version: str | None, platforms: Sequence[str]) -> dict[str, str]:
    """PEP 508 marker values for the target (this machine's, overridden by what is known of the target)."""
    env = dict(_packaging().markers.default_environment())
    if python_version:
        env["python_version"] = python_version if "." in python_version else f"{python_version[0]}.{python_version[1:]}"
        env["python_full_version"] = env["python_version"] + ".0"
        env["implementation_name"] = "cpython"
        env["platform_python_implementation"] = "CPython"
        env["implementation_version"] = env["python_full_version"]
    if platforms:
        tag = platforms[0]
        if tag.startswith(("manylinux", "musllinux", "linux")):
            env.update(sys_platform="linux", os_name="posix", platform_system="Linux")
        elif tag.startswith("macosx"):
            env.update(sys_platform="darwin", os_name="posix", platform_system="Darwin")
        elif tag.startswith("win"):
            env.update(sys_platform="win32", os_name="nt", platform_system="Windows")
        arch = re.sub(r"^(manylinux_\d+_\d+|musllinux_\d+_\d+|manylinux\d+|linux|macosx_\d+_\d+|win)_?", "", tag)
        if arch:
            env["platform_machine"] = {"amd64": "AMD64"}.get(arch, arch)
    return env


def _wheel_requires(path: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA."""
    with zipfile.ZipFile(path) as zf:
        names = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            raise FactoryError(f"{path.name} has no single .dist-info/METADATA; the wheel is damaged. "
                               "Fix: build the wheelhouse again")
        meta = HeaderParser().parsestr(zf.read(names[0]).decode("utf-8", "replace"))
    return meta.get_all("Requires-Dist") or []


def closure_gaps(folder: Path, roots: Sequence[str], env: dict[str, str]) -> tuple[list[str], list[str]]:
    """What the target needs that ``folder`` lacks: ``(missing requirements, conflicts)``.

    Starts from ``roots`` (requirement strings) and follows every wheel's
    ``Requires-Dist`` whose marker holds in ``env`` for the extras asked of it.
    A missing project comes back as a requirement string (without marker) that
    pip can download; a present version outside a needed specifier is a conflict.
    """
    pk = _packaging()
    wheels: dict[str, tuple[str, Path]] = {}
    for path in folder.glob("*.whl"):
        name, version = parse_wheel_filename(path.name)
        wheels[name] = (version, path)
    missing: dict[str, str] = {}
    conflicts: list[str] = []
    seen: set[tuple[str, frozenset[str]]] = set()
    queue: list[Any] = [req for req in map(pk.requirements.Requirement, roots)
                        if req.marker is None or req.marker.evaluate({**env, "extra": ""})]
    requires_cache: dict[str, list[str]] = {}
    while queue:
        req = queue.pop()
        name = canonical_name(req.name)
        extras = frozenset(canonical_name(e) for e in req.extras)
        present = wheels.get(name)
        if present is None:
            extra_txt = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            missing.setdefault(f"{name}{extra_txt}", f"{name}{extra_txt}{req.specifier}")
            continue
        version, path = present
        if req.specifier and not req.specifier.contains(pk.version.Version(version), prereleases=True):
            conflicts.append(f"{name} {version} is in the wheelhouse, the target needs {name}{req.specifier}")
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name not in requires_cache:
            requires_cache[name] = _wheel_requires(path)
        for line in requires_cache[name]:
            dep = pk.requirements.Requirement(line)
            if dep.marker is not None and not any(
                    dep.marker.evaluate({**env, "extra": e}) for e in (sorted(extras) or [""])):
                continue
            queue.append(dep)
    return sorted(missing.values()), conflicts


def _write_index(folder: Path, *, project_version: str, extras: tuple[str, ...], packages: tuple[str, ...],
                 python_version: str | None, platforms: tuple[str, ...]) -> WheelhouseReport:
    """Hash every wheel in ``folder`` and write requirements.txt, SHA256SUMS and manifest.json."""
    wheels = _index(folder)
    if not any(w.name == PROJECT_NAME for w in wheels):
        raise FactoryError(f"the wheelhouse has no {PROJECT_NAME} wheel (an internal step failed silently)")
    by_name: dict[str, list[WheelEntry]] = {}
    for w in wheels:
        by_name.setdefault(w.name, []).append(w)
    lines = ["# Offline install, every wheel pinned by digest:",
             f"#   pip install --no-index --find-links . --require-hashes -r {REQUIREMENTS}"]
    for name in sorted(by_name):
        group = by_name[name]
        versions = sorted({w.version for w in group})
        if len(versions) != 1:
            raise FactoryError(f"the wheelhouse holds {name} in several versions {versions}. "
                               "Fix: build it again into an empty folder")
        hashes = " ".join(f"--hash=sha256:{w.sha256}" for w in group)
        lines.append(f"{name}=={versions[0]} {hashes}")
    (folder / REQUIREMENTS).write_text("\n".join(lines) + "\n")
    (folder / SHA256SUMS).write_text("".join(f"{w.sha256}  {w.filename}\n" for w in wheels))
    manifest = {
        "format": MANIFEST_FORMAT,
        "project": PROJECT_NAME,
        "version": project_version,
        "extras": list(extras),
        "packages": list(packages),
        "target": {"python_version": python_version, "platforms": list(platforms)},
        "built_with": {"python": ".".join(map(str, sys.version_info[:3])), "platform": sys.platform},
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "wheels": [{"file": w.filename, "name": w.name, "version": w.version, "sha256": w.sha256,
                    "size": w.size} for w in wheels],
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return WheelhouseReport(folder, project_version, extras, packages, python_version, platforms, wheels)


def _replace(tmp: Path, dest: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``dest``; an existing wheelhouse is replaced only when asked."""
    if not dest.exists():
        tmp.rename(dest)
        return
    if dest.is_dir() and not any(dest.iterdir()):
        dest.rmdir()
        tmp.rename(dest)
        return
    if not overwrite:
        raise FactoryError(f"{dest} already exists and is not empty. Fix: pass --force to replace it, "
                           "or choose another folder")
    if not (dest / MANIFEST).is_file():
        raise FactoryError(f"{dest} is not a wheelhouse (no {MANIFEST}); refusing to replace it. "
                           "Fix: choose an empty or new folder")
    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    old.rmdir()
    dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- public API


def build_wheelhouse(
    dest: Path,
    extras: Sequence[str],
    python_version: str | None,
    platform: str | None,
    project_dir: Path,
    *,
    packages: Sequence[str] = (),
    constraints: Path | None = None,
    pip_args: Sequence[str] = (),
    overwrite: bool = False,
    echo: bool = False,
) -> WheelhouseReport:
    """Build a wheelhouse of model-factory (with ``extras``) for one target.

    ``python_version`` ("3.12") and ``platform`` ("manylinux_2_28_x86_64")
    describe the target; leave both ``None`` for the machine running this.
    ``packages`` are further requirement specifiers to include (for example the
    ``tensorrt-cu13`` build that matches the serving image); ``constraints`` is a
    pip constraints file (the way to pick e.g. ``torch==2.13.0+cpu``), and
    ``pip_args`` are passed to every pip call as they are (``--extra-index-url
    URL``, ``--find-links DIR``). ``echo`` lets pip print its progress.

    Needs the package index (or a mirror) while it runs; the result installs
    with none.
    """
    dest = Path(dest).absolute()
    project_dir = Path(project_dir)
    version, known_extras = _read_project(project_dir)
    extras_t = _normalize_extras(extras, known_extras)
    python_version = _normalize_python_version(python_version)
    platforms = target_platforms(platform)
    packages_t = tuple(p.strip() for p in packages if p.strip())
    if constraints is not None and not Path(constraints).is_file():
        raise FactoryError(f"constraints file {constraints} does not exist. Fix: pass an existing file")
    if dest.exists() and not dest.is_dir():
        raise FactoryError(f"{dest} exists and is not a folder. Fix: choose another destination")
    if dest.is_dir() and any(dest.iterdir()) and not overwrite:
        raise FactoryError(f"{dest} already exists and is not empty. Fix: pass --force to replace it, "
                           "or choose another folder")
    dest.parent.mkdir(parents=True, exist_ok=True)

    cross = python_version is not None or bool(platforms)
    common = list(pip_args)
    if constraints is not None:
        common += ["--constraint", str(Path(constraints).absolute())]

    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        with tempfile.TemporaryDirectory(prefix="model-factory-src-") as scratch:
            src = _copy_source(project_dir, Path(scratch), skip=[dest, tmp])
            own = Path(scratch) / "own"
            _pip(["wheel", "--no-deps", "--wheel-dir", str(own), *list(pip_args), str(src)], echo,
                 f"building the {PROJECT_NAME} wheel")
            own_wheels = sorted(own.glob("model_factory-*.whl"))
            if len(own_wheels) != 1:
                raise FactoryError(f"expected one {PROJECT_NAME} wheel, pip made {[p.name for p in own_wheels]}")
            shutil.copy2(own_wheels[0], tmp / own_wheels[0].name)
            requirement = f"{own_wheels[0]}[{','.join(extras_t)}]" if extras_t else str(own_wheels[0])
            if cross:
                target = ["--only-binary=:all:"]
                if python_version:
                    target += ["--python-version", python_version]
                for tag in platforms:
                    target += ["--platform", tag]
                _pip(["download", "--dest", str(tmp), *target, *common, requirement, *packages_t], echo,
                     "downloading the dependencies")
            else:
                _pip(["wheel", "--wheel-dir", str(tmp), *common, requirement, *packages_t], echo,
                     "collecting the dependencies")
            env = target_environment(python_version, platforms)
            roots = [f"{PROJECT_NAME}[{','.join(extras_t)}]" if extras_t else PROJECT_NAME, *packages_t]
            for _ in range(5):
                missing, conflicts = closure_gaps(tmp, roots, env)
                if conflicts:
                    raise FactoryError("the target needs other versions than pip chose here:\n  "
                                       + "\n  ".join(conflicts) + "\nFix: build the wheelhouse with a Python of the "
                                       "target's version (pip evaluates markers for the Python it runs under)")
                if not missing:
                    break
                if not cross:
                    raise FactoryError(f"pip left out {missing} that this machine needs (a pip bug?). "
                                       "Fix: add them with --with")
                _pip(["download", "--dest", str(tmp), *target, *common, *missing], echo,
                     f"downloading what the target needs and pip skipped ({', '.join(missing)})")
            else:
                raise FactoryError(f"the wheelhouse is still missing {missing} after five passes. Fix: add them with --with")
        from model_factory.backend.engines.onnxruntime import onnxruntime_conflict

        clash = onnxruntime_conflict(e.name for e in _index(tmp))
        if clash:
            raise FactoryError(f"the wheelhouse for extras {','.join(extras_t)}: {clash}")
        report = _write_index(tmp, project_version=version, extras=extras_t, packages=packages_t,
                              python_version=python_version, platforms=platforms)
        tmp.chmod(0o755)  # mkdtemp made it private; a wheelhouse is meant to be shared and copied
        _replace(tmp, dest, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return WheelhouseReport(dest, report.project_version, report.extras, report.packages,
                            report.python_version, report.platforms, report.wheels)


def check_wheelhouse(path: Path) -> WheelhouseReport:
    """Check a wheelhouse against its manifest: every wheel present, intact, and nothing unlisted.

    Run it after carrying a wheelhouse into the network, before installing from it.
    """
    path = Path(path)
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise FactoryError(f"{path} has no {MANIFEST}, so it is not a model-factory wheelhouse. "
                           "Fix: build one with: model-factory wheelhouse DIR")
    try:
        manifest = json.loads(manifest_file.read_text())
        listed = {w["file"]: w for w in manifest["wheels"]}
        target = manifest["target"]
    except (ValueError, KeyError, TypeError) as exc:
        raise FactoryError(f"{manifest_file} is damaged ({exc}). Fix: copy the wheelhouse again") from exc
    if manifest.get("format") != MANIFEST_FORMAT:
        raise FactoryError(f"{manifest_file} has format {manifest.get('format')!r}, this model-factory reads "
                           f"{MANIFEST_FORMAT}. Fix: check it with the model-factory version that built it")
    present = {p.name for p in path.iterdir() if p.name not in (MANIFEST, REQUIREMENTS, SHA256SUMS)}
    problems = [f"missing: {name}" for name in sorted(set(listed) - present)]
    problems += [f"not in the manifest: {name}" for name in sorted(present - set(listed))]
    entries = []
    for name in sorted(set(listed) & present):
        digest = digest_path(path / name)
        if digest != listed[name]["sha256"]:
            problems.append(f"sha256 mismatch: {name}")
        pname, version = parse_wheel_filename(name)
        entries.append(WheelEntry(name, pname, version, digest, (path / name).stat().st_size))
    if problems:
        raise FactoryError(f"the wheelhouse {path} does not match its manifest:\n  " + "\n  ".join(problems)
                           + "\nFix: copy the wheelhouse again from the machine that built it")
    return WheelhouseReport(path, manifest["version"], tuple(manifest["extras"]), tuple(manifest.get("packages", [])),
                            target.get("python_version"), tuple(target.get("platforms", [])), tuple(entries))
