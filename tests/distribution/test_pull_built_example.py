"""The README's example as ``model-factory build`` writes it (acceptance data included), pushed and pulled
through the real registry over TLS and over ``--plain-http``: every byte comes back.

The example's ``1/acceptance/inputs.json`` is a JSON *list*: a registry client that parsed every body as an
error document broke on it (``'list' object has no attribute 'get'``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from test_push_pull import snapshot

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLE_RECIPE = Path(__file__).resolve().parents[2] / "model_factory" / "examples" / "minilm.toml"


@pytest.fixture(scope="module")
def built_example(tmp_path_factory):
    """``model-factory build`` of the shipped MiniLM recipe (its precisions; no TensorRT), signed."""
    from model_factory.cli.main import main
    from model_factory.demo import write_key_policy

    root = tmp_path_factory.mktemp("built-example")
    runner = CliRunner()
    r = runner.invoke(main, ["keygen", str(root / "keys")])
    assert r.exit_code == 0, r.output
    recipe = root / "minilm.toml"
    text = EXAMPLE_RECIPE.read_text().replace('path = "model_repository"', f'path = "{root / "repo"}"')
    recipe.write_text(text.replace("enabled = true", "enabled = false", 1))
    for f in ("calibration.txt", "heldout.txt"):
        (root / f).write_bytes((EXAMPLE_RECIPE.parent / f).read_bytes())
    r = runner.invoke(main, ["build", str(recipe), "--key", str(root / "keys" / "signing-key.pem")])
    assert r.exit_code == 0, r.output
    model_dir = root / "repo" / "minilm"
    inputs = model_dir / "1" / "acceptance" / "inputs.json"
    assert isinstance(json.loads(inputs.read_text()), list)  # the body that broke the old status check
    return root / "repo", model_dir, write_key_policy(root / "policy.toml", [root / "keys" / "signing-key.pub"])


@pytest.mark.parametrize("transport", ["tls", "plain-http"])
def test_the_built_example_pushes_and_pulls_byte_identical(transport, request, built_example, tmp_path):
    from model_factory.cli.main import main

    repo, model_dir, policy = built_example
    reg = request.getfixturevalue("registry" if transport == "tls" else "plain_registry")
    how = ["--registry-config", str(reg.config)] + (["--ca-file", str(reg.ca)] if transport == "tls"
                                                     else ["--plain-http"])
    ref = f"oci://{reg.host}/examples/minilm:1"
    runner = CliRunner()
    r = runner.invoke(main, ["push", str(repo), "--model", "minilm", ref, *how])
    assert r.exit_code == 0, r.output
    dest = tmp_path / "pulled"
    r = runner.invoke(main, ["pull", ref, str(dest), "--policy", str(policy), *how])
    assert r.exit_code == 0, r.output
    assert snapshot(dest / "minilm") == snapshot(model_dir)
