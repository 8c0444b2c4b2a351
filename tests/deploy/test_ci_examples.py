"""examples/ci/deploy-*.yml: install from the wheelhouse with no index, verify, and only then deploy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from .validators import check_jsonschema

CI = Path(__file__).resolve().parents[2] / "examples" / "ci"
GITHUB = CI / "deploy-github.yml"
GITLAB = CI / "deploy-gitlab.yml"

INSTALL = re.compile(r'pip install --no-index --find-links "\$WHEELHOUSE" "model-factory\[sign\]"')
VERIFY = "model-factory verify --json --policy policy.toml model_repository"
DEPLOY = "docker compose up -d --wait --force-recreate triton"


def _no_pip_install_with_an_index(text: str) -> None:
    for line in text.splitlines():
        if "pip install" in line:
            assert "--no-index" in line, line
    assert "PIP_NO_INDEX" in text


def test_github_installs_verifies_then_deploys() -> None:
    text = GITHUB.read_text()
    _no_pip_install_with_an_index(text)
    wf = yaml.safe_load(text)
    (job,) = wf["jobs"].values()
    assert job["defaults"]["run"]["shell"] == "bash"  # -eo pipefail, so `verify | tee` still fails the step
    runs = [(i, s) for i, s in enumerate(job["steps"]) if "run" in s]
    install = next(i for i, s in runs if INSTALL.search(s["run"]))
    verify = next(i for i, s in runs if VERIFY in s["run"])
    deploy = next(i for i, s in runs if DEPLOY in s["run"])
    assert install < verify < deploy
    assert "sha256sum --check" in job["steps"][install]["run"]
    # The deploy step runs only when everything before it succeeded (no `if: always()` there).
    assert "if" not in job["steps"][deploy]
    between = job["steps"][verify + 1:deploy]
    assert all(s.get("if") == "always()" and "run" not in s for s in between), "only the report upload may sit between"


def test_gitlab_installs_verifies_then_deploys() -> None:
    text = GITLAB.read_text()
    _no_pip_install_with_an_index(text)
    ci = yaml.safe_load(text)
    assert ci["stages"] == ["verify", "deploy"]
    template = ci[ci["verify"]["extends"]]
    assert any(INSTALL.search(line) for line in template["before_script"])
    assert any("sha256sum --check" in line for line in template["before_script"])
    assert any(VERIFY in line for line in ci["verify"]["script"])
    assert ci["verify"]["artifacts"]["when"] == "always"
    deploy = ci["deploy"]
    assert deploy["stage"] == "deploy" and deploy["needs"] == ["verify"]
    assert any(DEPLOY in line for line in deploy["script"])
    assert "when" not in deploy  # not `when: always`: a failed verify stops it


def test_verify_command_has_these_options() -> None:
    cli_signing = pytest.importorskip("model_factory.cli.signing")
    opts = {o for p in cli_signing.verify.params for o in p.opts}
    assert {"--json", "--policy"} <= opts


def test_github_workflow_matches_its_schema() -> None:
    check_jsonschema("vendor.github-workflows", GITHUB)


def test_gitlab_pipeline_matches_its_schema() -> None:
    check_jsonschema("vendor.gitlab-ci", GITLAB)
