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
    assert [s for s in said if s.startswith("[sandbox]")] == [HAVE.line()]
    assert HAVE.line().startswith(f"[sandbox] on: Landlock ABI {HAVE.landlock_abi}")


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
    line = bare.line()
    assert line.startswith("[sandbox] off here: this kernel has no Landlock") and "Fix:" in line and "\n" not in line


def test_the_network_filter_is_a_whole_bpf_program() -> None:
    prog = sandbox.network_filter("x86_64")
    assert len(prog) % 8 == 0
    ops = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    for i, (code, jt, jf, _k) in enumerate(ops):  # every jump lands inside the program
        if code & 0x07 == 0x05:
            assert i + 1 + max(jt, jf) < len(ops)
        else:
            assert (jt, jf) == (0, 0)
    assert ops[-1][0] == 0x06 and ops[-1][3] & 0xFFFF == 13  # the last: return EACCES
