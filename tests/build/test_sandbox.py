"""Build in a sandbox: export, quantize and engine build walled in by Landlock (files) and seccomp (no sockets).

A torch source's own code runs inside the same walls: one that reads /etc/passwd, writes outside its work
folder or opens a network socket fails, and the build says so in one line. Skipped where the kernel has
neither (the refusal of --require-sandbox there is tested with the kernel's answer replaced).
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from model_factory import sandbox
from model_factory.errors import FactoryError

HAVE = sandbox.support()
needs_walls = pytest.mark.skipif(not HAVE.complete, reason=f"this kernel lacks the sandbox: {HAVE.missing}")

FACTORY = '''
import socket

import torch


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.proj(x).sum(dim=1)


def _model():
    torch.manual_seed(0)
    return Scale(), {"x": torch.randn(2, 5, 4)}


def good():
    return _model()


def read_passwd():
    open("/etc/passwd").read()
    return _model()


def write_outside():
    open(OUTSIDE, "w").write("escaped")
    return _model()


def open_socket():
    socket.socket(socket.AF_INET, socket.SOCK_STREAM).connect(("127.0.0.1", 9))
    return _model()
'''


def _recipe(folder: Path, factory: str):
    from model_factory.recipe import parse_recipe

    return parse_recipe({"model": {"name": "walled", "task": "generic"},
                         "source": {"kind": "torch", "factory": f"walled_factory:{factory}"},
                         "inputs": [{"name": "x", "dtype": "FP32", "dims": [-1, 4]}],
                         "outputs": [{"name": "y", "dtype": "FP32", "dims": [3]}],
                         "shapes": {"max_batch": 4, "max_sequence_length": 16, "sequence_buckets": [16]},
                         "repository": {"path": str(folder / "out" / "repo"), "instance_kind": "cpu"}}, folder)


@pytest.fixture()
def source(tmp_path: Path) -> Path:
    folder = tmp_path / "vendor"
    folder.mkdir()
    (folder / "walled_factory.py").write_text(f"OUTSIDE = {str(folder / 'escaped.txt')!r}\n" + FACTORY)
    return folder


def _build(recipe, sandbox_mode="auto"):
    from model_factory.build.pipeline import build

    said: list[str] = []
    result = build(recipe, progress=said.append, engines=False, isolate=True, sandbox=sandbox_mode)
    return result, said


@needs_walls
@pytest.mark.slow
def test_a_walled_torch_source_builds_and_the_build_says_the_sandbox_is_on(source: Path) -> None:
    result, said = _build(_recipe(source, "good"))
    assert (result.version_dir / "model.onnx").is_file()
    assert [s for s in said if s.startswith("[sandbox]")] == [sandbox.support_line(HAVE)]
    assert sandbox.support_line(HAVE).startswith(f"[sandbox] on: Landlock ABI {HAVE.landlock_abi}")


@needs_walls
@pytest.mark.slow
@pytest.mark.parametrize("factory, refused", [("read_passwd", "/etc/passwd"), ("write_outside", "escaped.txt"),
                                              ("open_socket", "a network socket")])
def test_a_torch_source_cannot_read_write_or_connect_beyond_its_walls(source: Path, factory: str,
                                                                     refused: str) -> None:
    with pytest.raises(FactoryError) as err:
        _build(_recipe(source, factory))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("the build sandbox stopped the export stage: permission denied for")
    assert refused in message and "Fix:" in message
    assert not (source / "escaped.txt").exists()


def test_require_sandbox_refuses_a_kernel_without_it_and_auto_says_so_in_one_line(source: Path,
                                                                                  monkeypatch) -> None:
    bare = sandbox.Support(0, False, ("this kernel has no Landlock (before 5.13, or built without it)",
                                      "this kernel has no seccomp filters (/proc/sys/kernel/seccomp missing)"))
    monkeypatch.setattr(sandbox, "support", lambda: bare)
    with pytest.raises(FactoryError, match=r"^--require-sandbox: this kernel has no Landlock .*Fix: "):
        _build(_recipe(source, "good"), "require")
    assert not (source / "out" / "repo").exists()
    line = sandbox.support_line(bare)
    assert line.startswith("[sandbox] off here: this kernel has no Landlock") and "Fix:" in line and "\n" not in line


@pytest.mark.parametrize("no_new_processes", [False, True])
@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_syscall_filter_is_a_whole_bpf_program(machine: str, no_new_processes: bool) -> None:
    prog = sandbox.syscall_filter(machine, no_new_processes)
    assert len(prog) % 8 == 0
    ops = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    for i, (code, jt, jf, _k) in enumerate(ops):  # every jump lands inside the program
        if code & 0x07 == 0x05:
            assert i + 1 + max(jt, jf) < len(ops)
        else:
            assert (jt, jf) == (0, 0)
    assert ops[-1][0] == 0x06 and (0x00050000 | 13) in [k for code, _, _, k in ops if code == 0x06]


SERVE_WALLS = """
import os, socket, subprocess, sys, threading
from model_factory.backend.operations import sandbox
sandbox.apply(sandbox.Walls(read=tuple(sys.argv[2:]), write=(sys.argv[1],), read_files=("/etc/ld.so.cache",),
                            no_new_processes=True))
def attempt(name, fn):
    try:
        fn()
        print(name, "allowed")
    except OSError as exc:
        print(name, "refused", exc.errno)
attempt("thread", lambda: [t.start() or t.join() for t in [threading.Thread(target=lambda: None)]])
attempt("fork", lambda: os._exit(0) if os.fork() == 0 else None)
attempt("exec", lambda: subprocess.run(["/bin/true"]))
attempt("socket", lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM))
attempt("passwd", lambda: open("/etc/passwd").read())
attempt("scratch", lambda: open(os.path.join(sys.argv[1], "ok"), "w").write("x"))
"""


@needs_walls
def test_serving_walls_allow_threads_and_refuse_processes_sockets_and_files(tmp_path: Path) -> None:
    import subprocess
    import sys

    from model_factory.build.walls import python_paths

    done = subprocess.run([sys.executable, "-c", SERVE_WALLS, str(tmp_path), *python_paths()], capture_output=True,
                          text=True, timeout=60)
    said = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert said == {"thread": "allowed", "fork": "refused 13", "exec": "refused 13", "socket": "refused 13",
                    "passwd": "refused 13", "scratch": "allowed"}, done.stdout + done.stderr


RECIPE_TOML = '''
[model]
name = "walled"
task = "generic"

[source]
kind = "torch"
factory = "walled_factory:{factory}"

[[inputs]]
name = "x"
dtype = "FP32"
dims = [-1, 4]

[[outputs]]
name = "y"
dtype = "FP32"
dims = [3]

[shapes]
max_batch = 4
max_sequence_length = 16
sequence_buckets = [16]

[repository]
path = "out/repo"
instance_kind = "cpu"
'''


def _cli(source: Path, factory: str, *args: str):
    from click.testing import CliRunner

    from model_factory.cli.main import main

    recipe = source / f"{factory}.toml"
    recipe.write_text(RECIPE_TOML.format(factory=factory))
    return CliRunner().invoke(main, [args[0], str(recipe), *args[1:]])


@needs_walls
@pytest.mark.slow
def test_the_export_command_runs_a_torch_source_in_the_sandbox_and_no_sandbox_is_the_escape(source: Path) -> None:
    """``model-factory export`` alone walls the source's code in as ``build`` does: a factory that reads /etc/passwd
    is refused in one line; ``--no-sandbox`` runs it (a source you trust)."""
    refused = _cli(source, "read_passwd", "export")
    assert refused.exit_code == 1, refused.output
    last = refused.output.strip().splitlines()[-1]
    assert "the build sandbox stopped the export stage: permission denied for" in last and "/etc/passwd" in last
    assert "Fix:" in last
    assert sandbox.support_line(HAVE) in refused.output
    trusted = _cli(source, "read_passwd", "export", "--no-sandbox")
    assert trusted.exit_code == 0, trusted.output
    assert "[sandbox] off (--no-sandbox)" in trusted.output and "wrote " in trusted.output
    both = _cli(source, "good", "export", "--no-sandbox", "--require-sandbox")
    assert both.exit_code == 1 and "contradict each other" in both.output


def read_passwd_stage(recipe, progress=None):
    """A stage body that reads what no stage may (module level: the spawned child imports it by name)."""
    return open("/etc/passwd").read()[:0] + "read"


@needs_walls
@pytest.mark.parametrize("stage", ["export", "quantize", "build-engine"])
def test_each_command_s_stage_runs_walled_and_no_sandbox_runs_it_unwalled(source: Path, stage: str) -> None:
    """``run_stage`` is what export, quantize and build-engine run their stage through."""
    from model_factory.build.pipeline import run_stage

    recipe = _recipe(source, "good")
    said: list[str] = []
    with pytest.raises(FactoryError, match=rf"^the build sandbox stopped the {stage} stage: permission denied "
                                           r"for .*/etc/passwd.*Fix:"):
        run_stage(recipe, stage, read_passwd_stage, recipe, progress=said.append)
    assert said == [sandbox.support_line(HAVE)]
    assert run_stage(recipe, stage, read_passwd_stage, recipe, progress=said.append, sandbox="off") == "read"
    assert said[-1].startswith("[sandbox] off (--no-sandbox)")


def test_quantize_and_build_engine_take_the_sandbox_options() -> None:
    from model_factory.cli.main import main

    for name in ("export", "quantize", "build-engine", "build"):
        options = {o for p in main.commands[name].params for o in p.opts}
        assert {"--no-sandbox", "--require-sandbox"} <= options, name
