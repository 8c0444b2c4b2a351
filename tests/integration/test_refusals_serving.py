"""A model that cannot load is refused in one line with the fix, by ``accept`` and ``serve`` alike (the
stack only with ``--debug``), and ``serve`` with nothing servable exits non-zero unless told to wait."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zoo_models  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLI = str(Path(sys.executable).parent / "model-factory")
SERVE = ["serve", "--allow-unsigned", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
         "--watch-interval", "0", "--no-cost-cache"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """The one-row model packaged without build's load check (as an older build, or a hand-made package, would)."""
    import numpy as np

    from model_factory.build.repository import package_model
    from model_factory.build_engines.golden import write_acceptance_data
    from model_factory.recipe import parse_recipe

    root = tmp_path_factory.mktemp("refusals")
    zoo_models.make_one_row_onnx(root / "one_row.onnx")
    np.savez(root / "heldout.npz", k=np.zeros((4, 8), np.int64))  # zeros: the one value the table takes
    recipe = parse_recipe({"model": {"name": "one-row", "task": "generic"},
                           "source": {"kind": "onnx", "path": "one_row.onnx"},
                           "shapes": {"max_batch": 4, "max_sequence_length": 8, "sequence_buckets": [8]},
                           "quantization": {"heldout_data": "heldout.npz"},
                           "repository": {"path": str(root / "repo"), "instance_count": 1}}, root)
    golden = write_acceptance_data(recipe, root / "one_row.onnx", None, root / "acceptance")
    package_model(recipe, {"model.onnx": root / "one_row.onnx"}, parameters={"cost_model": "0.001,1e-6,1e-9"},
                  acceptance_dir=golden)
    return root / "repo"


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([CLI] + args, capture_output=True, text=True, timeout=timeout)


def _one_line_refusal(text: str) -> str:
    lines = [line for line in text.splitlines() if "one-row" in line and "warm-up" in line]
    assert len(lines) == 1, text
    assert "Fix:" in lines[0] and "Traceback" not in text and "\nAt:" not in text and "\x1b[" not in text
    return lines[0]


def test_serve_with_nothing_servable_exits_non_zero_with_one_line_per_refusal(repo: Path) -> None:
    done = _run(SERVE + [str(repo)])
    assert done.returncode == 1, done.stdout + done.stderr
    line = _one_line_refusal(done.stderr)
    assert "failed to load" in line and "indices element out of data bounds" in line
    assert "no model could be served" in done.stderr and "--allow-empty" in done.stderr


def test_the_stack_is_shown_only_with_debug(repo: Path) -> None:
    done = _run(["--debug"] + SERVE + [str(repo)])
    assert done.returncode == 1 and "Traceback" in done.stderr, done.stderr[-2000:]


def test_allow_empty_keeps_the_server_up_for_later_loads(repo: Path) -> None:
    proc = subprocess.Popen([CLI] + SERVE + ["--allow-empty", str(repo)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out = []
        for line in proc.stdout:  # until serve says it is up
            out.append(line)
            if "Ctrl-C to stop" in line:
                break
        assert any("no model yet (--allow-empty)" in line for line in out), out
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    _one_line_refusal(err)


def test_accept_goes_through_the_load_path_and_refuses_in_one_line(repo: Path) -> None:
    done = _run(["accept", str(repo)])
    assert done.returncode == 1, done.stdout + done.stderr
    line = _one_line_refusal(done.stdout)
    assert line.startswith("one-row: FAIL: the model does not load here (CPU instance)")
