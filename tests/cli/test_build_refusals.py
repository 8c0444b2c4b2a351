"""``model-factory build`` as a user runs it: the summary is the version folder's listing, a TensorRT stage
that cannot run here is said in one line, and a model that cannot run its own warm-up fails the build in
one line with the fix (no stack, no ONNX Runtime stderr)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zoo_models  # noqa: E402

pytestmark = [pytest.mark.slow]

# The console script's main with TensorRT made unimportable in this process, as on a machine without it
# (TensorRT-RTX installs here, so its absence is the one thing this test sets up).
NO_TENSORRT = ("import sys; sys.modules['tensorrt'] = None; sys.modules['tensorrt_rtx'] = None; "
               "from model_factory.cli.main import main; sys.argv[0] = 'model-factory'; main()")


def run_cli(args: list[str], cwd: Path, without_tensorrt: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, "-c", NO_TENSORRT] if without_tensorrt else [str(Path(sys.executable).parent /
                                                                          "model-factory")]
    return subprocess.run(cmd + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_summary_lists_the_version_folder_and_skipped_engines_are_said(tmp_path: Path) -> None:
    zoo_models.make_matmul_onnx(tmp_path / "matmul.onnx")
    rng = np.random.default_rng(0)
    for name, n in (("calib", 32), ("heldout", 12)):
        np.savez(tmp_path / f"{name}.npz", x=rng.normal(size=(n, 8)).astype(np.float32))
    (tmp_path / "mm.toml").write_text(
        'precisions = ["fp32", "int8"]\n[model]\nname = "mm"\ntask = "generic"\n[source]\nkind = "onnx"\n'
        'path = "matmul.onnx"\n[shapes]\nmax_batch = 4\nmax_sequence_length = 1\nsequence_buckets = [1]\n'
        '[quantization]\ncalibration_data = "calib.npz"\nheldout_data = "heldout.npz"\nmin_accuracy = 0.9\n'
        '[tensorrt]\nenabled = true\n[repository]\npath = "repo"\nserve = "int8"\ninstance_count = 1\n')
    done = run_cli(["build", "mm.toml"], tmp_path, without_tensorrt=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    version_dir = tmp_path / "repo" / "mm" / "1"
    assert lines[0] == f"built {version_dir}"
    listed = [line.strip() for line in lines[1:] if line.startswith("  ")]
    assert listed == sorted(p.name + ("/" if p.is_dir() else "") for p in version_dir.iterdir())
    assert "model.int8.onnx" in listed and "model.onnx" not in listed and "model.fp16.onnx" not in listed
    skipped = [line for line in done.stderr.splitlines() if "[build-engine]" in line]
    assert len(skipped) == 1, done.stderr
    assert ("[build-engine] skipped: model.fp32.plan, model.int8.plan not built: neither tensorrt nor "
            "tensorrt_rtx imports here") in skipped[0] and "Fix:" in skipped[0]


def test_a_model_that_cannot_run_its_warm_up_fails_the_build_in_one_line(tmp_path: Path) -> None:
    zoo_models.make_one_row_onnx(tmp_path / "one_row.onnx")
    (tmp_path / "one.toml").write_text(
        '[model]\nname = "one-row"\ntask = "generic"\n[source]\nkind = "onnx"\npath = "one_row.onnx"\n'
        '[shapes]\nmax_batch = 4\nmax_sequence_length = 8\nsequence_buckets = [8]\n'
        '[repository]\npath = "repo"\ninstance_count = 1\n')
    done = run_cli(["build", "one.toml"], tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "\x1b[" not in done.stderr + done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0] == done.stderr.splitlines()[-1], done.stderr
    assert "the packaged model one-row cannot load and run its warm-up" in errors[0]
    assert "Gather" in errors[0] and "Fix:" in errors[0]
    assert not (tmp_path / "repo" / "one-row").exists()  # nothing half-made went live
