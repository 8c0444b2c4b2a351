"""docker/factory-entrypoint.sh, run here with a stand-in ``model-factory`` that records its calls."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ENTRYPOINT = Path(__file__).resolve().parents[2] / "docker" / "factory-entrypoint.sh"

# Records each call; fails for a recipe whose file contains "fail".
FAKE_CLI = """#!/bin/sh
echo "$*" >> "$CALLS"
case "$2" in *.toml) if grep -q fail "$2"; then echo "build of $2 failed" >&2; exit 7; fi ;; esac
"""


@pytest.fixture
def site(tmp_path: Path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "model-factory"
    fake.write_text(FAKE_CLI)
    fake.chmod(0o755)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "model_repository").mkdir()
    key = tmp_path / "signing_key"
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "CALLS": str(tmp_path / "calls.txt"),
        "FACTORY_RECIPES_DIR": str(tmp_path / "recipes"),
        "FACTORY_REPOSITORY": str(tmp_path / "model_repository"),
        "FACTORY_SIGNING_KEY": str(key),
    }
    return {"root": tmp_path, "env": env, "key": key}


def run(site: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(ENTRYPOINT)], env=site["env"], capture_output=True, text=True, timeout=60)


def calls(site: dict) -> list[str]:
    path = Path(site["env"]["CALLS"])
    return path.read_text().splitlines() if path.exists() else []


def test_builds_and_signs_every_recipe_into_the_repository(site) -> None:
    root = site["root"]
    for name in ("b.toml", "a.toml"):
        (root / "recipes" / name).write_text("[model]\n")
    (root / "recipes" / "notes.txt").write_text("not a recipe")
    proc = run(site)
    assert proc.returncode == 0, proc.stderr
    repo, key = root / "model_repository", site["key"]
    assert calls(site) == [
        f"build {root}/recipes/a.toml --repository {repo} --key {key}",
        f"build {root}/recipes/b.toml --repository {repo} --key {key}",
    ]
    assert "built and signed 2 recipe(s)" in proc.stdout


def test_certificate_chain_is_passed_when_configured(site) -> None:
    root = site["root"]
    (root / "recipes" / "a.toml").write_text("[model]\n")
    chain = root / "chain.pem"
    chain.write_text("-----BEGIN CERTIFICATE-----\n")
    site["env"]["FACTORY_CERT_CHAIN"] = str(chain)
    proc = run(site)
    assert proc.returncode == 0, proc.stderr
    assert calls(site) == [f"build {root}/recipes/a.toml --repository {root}/model_repository "
                           f"--key {site['key']} --cert-chain {chain}"]
    chain.unlink()
    proc = run(site)
    assert proc.returncode == 2 and "cannot read the certificate chain" in proc.stderr


def test_a_failing_recipe_stops_the_run_with_its_exit_code(site) -> None:
    root = site["root"]
    (root / "recipes" / "a.toml").write_text("fail\n")
    (root / "recipes" / "b.toml").write_text("[model]\n")
    proc = run(site)
    assert proc.returncode == 7
    assert len(calls(site)) == 1
    assert "build of" in proc.stderr


def test_missing_key_is_named_with_the_fix(site) -> None:
    (site["root"] / "recipes" / "a.toml").write_text("[model]\n")
    site["key"].unlink()
    proc = run(site)
    assert proc.returncode == 2
    assert "cannot read the signing key" in proc.stderr and "SIGNING_KEY_FILE" in proc.stderr
    assert calls(site) == []


def test_no_recipes_is_an_error(site) -> None:
    proc = run(site)
    assert proc.returncode == 2
    assert "no recipes" in proc.stderr


def test_repository_that_is_a_file_is_an_error(site) -> None:
    (site["root"] / "recipes" / "a.toml").write_text("[model]\n")
    shutil.rmtree(site["root"] / "model_repository")
    (site["root"] / "model_repository").write_text("")
    proc = run(site)
    assert proc.returncode == 2 and "missing or not writable" in proc.stderr
    assert calls(site) == []


def test_missing_repository_is_an_error(site) -> None:
    (site["root"] / "recipes" / "a.toml").write_text("[model]\n")
    shutil.rmtree(site["root"] / "model_repository")
    proc = run(site)
    assert proc.returncode == 2 and "model_repository" in proc.stderr
