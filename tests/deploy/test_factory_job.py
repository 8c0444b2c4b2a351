"""deploy/helm/model-factory/files/factory-job.sh (one index of a factory Job), run with a stand-in model-factory.

The stand-in records its calls; ``build`` writes a model folder into the staging repository,
``verify`` passes unless the folder it checks holds a file named ``BAD``. The environment is
the one the rendered Job sets (names and values from the manifest, paths mapped to tmp_path).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from .helm_render import CHART, find, objects

SCRIPT = CHART / "files" / "factory-job.sh"

FAKE_CLI = """#!/bin/sh
echo "$*" >> "$CALLS"
case "$1" in
  build)
    repo=$4
    name=$(basename "$2" .toml)
    mkdir -p "$repo/$name/1"
    echo "built from $2" > "$repo/$name/1/model.onnx"
    echo 'name: "'$name'"' > "$repo/$name/config.pbtxt"
    [ -z "${FAIL_BUILD:-}" ] || exit 9
    ;;
  verify)
    eval last=\\${$#}
    if find "$last" -name BAD | grep -q .; then echo "verification failed" >&2; exit 1; fi
    ;;
esac
"""


@pytest.fixture
def site(tmp_path: Path) -> dict:
    pytest.importorskip("helm_python", reason="pip install 'model-factory[test]' (helm-python-sdk renders the chart)")
    job = next(d for d in objects("factory") if d["kind"] == "Job"
               and d["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-L4")
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "model-factory").write_text(FAKE_CLI)
    (bin_dir / "model-factory").chmod(0o755)
    mapped = {"/workspace/recipes": tmp_path / "recipes", "/workspace/repository": tmp_path / "repository",
              "/run/secrets/model-factory": tmp_path / "secrets", "/etc/model-factory/trust": tmp_path / "trust"}
    for folder in mapped.values():
        folder.mkdir()
    for name, value in env.items():
        for path, local in mapped.items():
            if value.startswith(path):
                env[name] = str(local) + value[len(path):]
    for recipe in env["FACTORY_RECIPES"].split():
        (tmp_path / "recipes" / recipe).write_text("[model]\n")
    Path(env["FACTORY_SIGNING_KEY"]).write_text("-----BEGIN PRIVATE KEY-----\n")
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", CALLS=str(tmp_path / "calls.txt"), HOSTNAME="build-0-abc")
    return {"env": env, "root": tmp_path}


def run(site: dict, index: int, **extra: str) -> subprocess.CompletedProcess:
    env = {**site["env"], "JOB_COMPLETION_INDEX": str(index), **extra}
    return subprocess.run(["sh", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def calls(site: dict) -> list[str]:
    path = Path(site["env"]["CALLS"])
    return path.read_text().splitlines() if path.exists() else []


def test_each_index_builds_its_recipe_into_its_product_and_tensorrt_folder(site) -> None:
    root = site["root"]
    dest = root / "repository" / "NVIDIA-L4" / "trt-10.13"
    staging = root / "repository" / ".staging" / "NVIDIA-L4" / "trt-10.13" / "bge-small-build-0-abc" / "repository"
    proc = run(site, 1)
    assert proc.returncode == 0, proc.stderr
    key, policy = site["env"]["FACTORY_SIGNING_KEY"], site["env"]["FACTORY_POLICY"]
    assert calls(site) == [
        f"build {root}/recipes/bge-small.toml --repository {staging} --key {key}",
        f"verify --no-release --policy {policy} {staging}",
        f"verify --no-release --policy {policy} --json {dest}",
    ]
    assert (dest / "bge-small" / "1" / "model.onnx").read_text() == f"built from {root}/recipes/bge-small.toml\n"
    # The staging folder is gone: nothing half-built is left beside the repository.
    assert not list((root / "repository" / ".staging").rglob("*.onnx"))


def test_a_rebuild_replaces_the_model_folder_by_rename(site) -> None:
    dest = site["root"] / "repository" / "NVIDIA-L4" / "trt-10.13"
    (dest / "minilm" / "1").mkdir(parents=True)
    (dest / "minilm" / "1" / "old.onnx").write_text("previous build")
    (dest / "other").mkdir()
    proc = run(site, 0)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (dest / "minilm" / "1").iterdir()) == ["model.onnx"]
    assert (dest / "other").is_dir()
    # The replaced folder is kept, one generation, for a rollback.
    previous = site["root"] / "repository" / ".previous" / "NVIDIA-L4" / "trt-10.13"
    assert (previous / "minilm" / "1" / "old.onnx").read_text() == "previous build"


def test_rollback_swaps_the_kept_folder_back_and_verifies(site) -> None:
    dest = site["root"] / "repository" / "NVIDIA-L4" / "trt-10.13"
    (dest / "minilm" / "1").mkdir(parents=True)
    (dest / "minilm" / "1" / "model.onnx").write_text("version in service before")
    assert run(site, 0).returncode == 0
    assert (dest / "minilm" / "1" / "model.onnx").read_text().startswith("built from")
    proc = run(site, 0, FACTORY_ACTION="rollback")
    assert proc.returncode == 0, proc.stderr
    assert (dest / "minilm" / "1" / "model.onnx").read_text() == "version in service before"
    assert calls(site)[-1] == f"verify --no-release --policy {site['env']['FACTORY_POLICY']} --json {dest}"
    # Rolling back again rolls forward: the two generations swap.
    assert run(site, 0, FACTORY_ACTION="rollback").returncode == 0
    assert (dest / "minilm" / "1" / "model.onnx").read_text().startswith("built from")


def test_rollback_with_nothing_kept_is_refused(site) -> None:
    proc = run(site, 0, FACTORY_ACTION="rollback")
    assert proc.returncode == 2 and "nothing to roll back" in proc.stderr
    assert calls(site) == []


def test_a_failed_build_never_reaches_the_repository(site) -> None:
    dest = site["root"] / "repository" / "NVIDIA-L4" / "trt-10.13"
    (dest / "minilm").mkdir(parents=True)
    (dest / "minilm" / "config.pbtxt").write_text("the signed version in service")
    proc = run(site, 0, FAIL_BUILD="1")  # the stand-in writes its model, then fails
    assert proc.returncode == 9
    assert (dest / "minilm" / "config.pbtxt").read_text() == "the signed version in service"
    assert [c.split()[0] for c in calls(site)] == ["build"]


def test_verify_failure_in_staging_stops_before_the_swap(site, tmp_path: Path) -> None:
    dest = site["root"] / "repository" / "NVIDIA-L4" / "trt-10.13"
    (dest / "minilm").mkdir(parents=True)
    (dest / "minilm" / "config.pbtxt").write_text("the signed version in service")
    wrapper = tmp_path / "bin" / "model-factory"
    # The build leaves a BAD file in what it built: staging verify must refuse it.
    wrapper.write_text(FAKE_CLI.replace('echo \'name: "\'$name\'"\'', 'touch "$repo/$name/BAD"; echo \'name: "\'$name\'"\''))
    proc = run(site, 0)
    assert proc.returncode == 1 and "verification failed" in proc.stderr
    assert (dest / "minilm" / "config.pbtxt").read_text() == "the signed version in service"
    assert [c.split()[0] for c in calls(site)] == ["build", "verify"]


def test_an_index_beyond_the_recipes_is_refused(site) -> None:
    proc = run(site, 2)
    assert proc.returncode == 2 and "only 2 recipe(s)" in proc.stderr
    assert calls(site) == []


def test_the_job_renders_the_script_it_runs() -> None:
    pytest.importorskip("helm_python")
    docs = objects("factory")
    job = next(d for d in docs if d["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == ["/bin/sh", "/opt/model-factory/factory-job.sh"]
    script = find(docs, "ConfigMap", "mf-model-factory-factory-job")["data"]["factory-job.sh"]
    assert script == SCRIPT.read_text()
