"""The stub's walls: what they grant, and that MODEL_FACTORY_SERVE_SANDBOX=off leaves a stub unwalled."""

from __future__ import annotations

from pathlib import Path

from model_factory.backend.operations import sandbox


def test_serving_walls_grant_the_model_folder_scratch_and_no_processes(tmp_path: Path) -> None:
    version = tmp_path / "repo" / "m" / "1"
    version.mkdir(parents=True)
    walls = sandbox.serving_walls(version, tmp_path / "scratch", writable=(str(tmp_path / "cache"),))
    assert str((tmp_path / "repo" / "m").resolve()) in walls.read
    assert str(tmp_path / "repo") not in walls.read  # not the other models
    assert set(walls.write) == {str(tmp_path / "scratch"), "/dev/shm", str(tmp_path / "cache")}
    assert walls.no_new_processes and not walls.exec_allowed and walls.tmpdir == str(tmp_path / "scratch")
    assert "/etc/passwd" not in walls.read_files and "/etc" not in walls.read


def test_the_switch_leaves_a_stub_unwalled_and_says_so(tmp_path: Path) -> None:
    state = sandbox.wall_in_stub(tmp_path, environ={sandbox.SERVE_ENV: "off"})
    assert state == f"off ({sandbox.SERVE_ENV}=off)" and sandbox.active() is None
