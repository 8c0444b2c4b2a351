"""The click layer: every command has help, user errors are one clean line, the base import is light."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from model_factory.cli.main import main

EXPECTED = {"export", "quantize", "build-engine", "package", "build", "keygen", "sign", "verify", "serve",
            "bench", "wheelhouse", "demo", "accept", "rebuild"}


def test_every_command_is_registered_and_has_help() -> None:
    assert EXPECTED <= set(main.commands)
    runner = CliRunner()
    for name in sorted(main.commands):
        result = runner.invoke(main, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)
        assert len(main.commands[name].help or "") > 20, f"{name} has no real help text"


@pytest.mark.parametrize("args, message", [
    (["export", "no-such-recipe.toml"], "does not exist"),
    (["package", "no-such-recipe.toml"], "does not exist"),
    (["build", "no-such-recipe.toml"], "does not exist"),
    (["serve", "no-such-repo", "--allow-unsigned"], "does not exist"),
])
def test_user_errors_are_clean(args, message) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert message in result.output and "Fix:" in result.output
    assert "Traceback" not in result.output


def test_base_package_imports_without_heavy_dependencies() -> None:
    """Importing the package and building the CLI loads no torch, onnxruntime, tensorrt or CUDA."""
    code = ("import sys, model_factory, model_factory.recipe, model_factory.build.repository, model_factory.serving.server, "
            "model_factory.cli.main, model_factory.backend.batching.grouping; "
            "heavy = {'torch', 'onnxruntime', 'tensorrt', 'tensorrt_rtx', 'cuda', 'transformers', 'onnx'}; "
            "print(sorted(heavy & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_missing_optional_dependency_names_the_extra() -> None:
    from model_factory.errors import FactoryError, require

    with pytest.raises(FactoryError, match=r"pip install 'model-factory\[export\]'"):
        require("no_such_module_for_sure", "export")


def test_package_notes_a_queue_policy_on_one_instance(tmp_path) -> None:
    """`package` says, before anything else, that a queue bound on a one-instance model meets Triton's stall."""
    import shutil
    from pathlib import Path

    examples = Path(__file__).resolve().parents[2] / "model_factory" / "examples"
    for name in ("minilm.toml", "calibration.txt", "heldout.txt"):
        shutil.copy(examples / name, tmp_path / name)
    recipe = tmp_path / "minilm.toml"
    recipe.write_text(recipe.read_text().replace('grouping = "cost_model"\n',
                                                 'grouping = "cost_model"\nmax_queue_size = 64\n')
                      .replace("instance_count = 2", "instance_count = 1"))
    result = CliRunner().invoke(main, ["package", str(recipe), "-r", str(tmp_path / "repo")])
    assert result.exit_code == 1  # nothing was exported in this folder: refused with the command to run
    assert "instance_count = 2" in result.output and "500 ms" in result.output
    assert "Traceback" not in result.output

    two = tmp_path / "two.toml"
    two.write_text(recipe.read_text().replace("instance_count = 1", "instance_count = 2"))
    assert "instance_count = 2" in two.read_text()
    result = CliRunner().invoke(main, ["package", str(two), "-r", str(tmp_path / "repo")])
    assert result.exit_code == 1 and "instance_count = 2" not in result.output
