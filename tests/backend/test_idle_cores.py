"""Idle cores lent between CPU instances: the cross-process ledger, the plan, and the engine's two sessions."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from model_factory.backend.batching.idle_cores import RUNTIME_DIR_ENV, BusyLedger, ledger_path, lending_plan


def _hold_busy(path: str, ready) -> None:
    """Another instance: computing until it is stopped (a signal ends the process, and its lock with it)."""
    import time

    ledger = BusyLedger(Path(path))
    with ledger.busy():
        ready.set()
        time.sleep(120)


@pytest.fixture
def other_instance(tmp_path: Path):
    """A process marked busy in the ledger at ``tmp_path/ledger``; yields (process, stop)."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_hold_busy, args=(str(tmp_path / "ledger"), ready))
    proc.start()
    assert ready.wait(60), "the other instance never marked itself busy"

    def stop() -> None:
        proc.terminate()
        proc.join(10)

    yield proc, stop
    if proc.is_alive():
        proc.kill()
        proc.join(10)


def test_another_instance_computing_is_seen_and_its_end_too(tmp_path: Path, other_instance) -> None:
    _, stop = other_instance
    me = BusyLedger(tmp_path / "ledger")
    assert me.others_busy()
    with me.busy():  # this instance's own mark is not "another one"
        assert me.others_busy()
    stop()
    assert not me.others_busy()
    me.close()


def test_a_killed_instance_never_keeps_its_mark(tmp_path: Path, other_instance) -> None:
    proc, _ = other_instance
    me = BusyLedger(tmp_path / "ledger")
    assert me.others_busy()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert not me.others_busy()  # the kernel dropped the dead process's lock
    me.close()


def _seen_busy_from_another_process(path: Path) -> bool:
    code = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\n"
            "try:\n    fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 0, 0)\nexcept OSError:\n    sys.exit(3)")
    return subprocess.run([sys.executable, "-c", code, str(path)], timeout=60).returncode == 3


def test_own_mark_is_reentrant_and_released(tmp_path: Path) -> None:
    a = BusyLedger(tmp_path / "ledger")
    with a.busy():
        with a.busy():
            pass
        assert _seen_busy_from_another_process(tmp_path / "ledger")  # the outer block still holds it
        assert not a.others_busy()  # and it is not "another instance" to itself
    assert not _seen_busy_from_another_process(tmp_path / "ledger")
    a.close()


def test_ledger_path_prefers_the_runtime_folder(tmp_path: Path) -> None:
    assert ledger_path({RUNTIME_DIR_ENV: str(tmp_path)}, server_pid=42) == tmp_path / "model-factory-cpu-busy-42"
    fallback = ledger_path({RUNTIME_DIR_ENV: str(tmp_path / "missing")}, server_pid=42)
    assert fallback.name == "model-factory-cpu-busy-42" and fallback.parent != tmp_path / "missing"


@pytest.mark.parametrize("cpus, own, instances, pinned, size, expected", [
    (2, 1, 2, False, 100, 2),
    (8, 2, 4, False, 100, 8),
    (2, 2, 2, True, 100, None),  # cpu_threads pinned: the user chose
    (4, 4, 1, False, 100, None),  # one instance already has every core
    (2, 2, 2, False, 100, None),  # nothing to borrow
    (2, 1, 2, False, 2 << 30, None),  # a second session of a large model costs its weights again
])
def test_lending_plan(cpus, own, instances, pinned, size, expected) -> None:
    wide, why = lending_plan(cpus, own, instances, pinned, size, 1 << 30)
    assert wide == expected and why


def _two_layer_onnx(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(32, 64)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(size=(64, 8)).astype(np.float32), "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_engine_borrows_only_inside_a_lone_window_and_only_when_the_others_are_idle(tmp_path: Path,
                                                                                     other_instance) -> None:
    from model_factory.backend.engines.onnxruntime import OnnxRuntimeEngine

    _, stop = other_instance
    _two_layer_onnx(tmp_path / "m.onnx")
    engine = OnnxRuntimeEngine(tmp_path / "m.onnx", threads=1, wide_threads=2, ledger=BusyLedger(tmp_path / "ledger"))
    assert engine.lends_cores
    x = {"x": np.random.default_rng(1).normal(size=(4, 32)).astype(np.float32)}
    narrow = engine.run(x)["y"]
    assert not engine.last_run_borrowed  # outside execute(): warm-up and cost timings keep their own threads
    with engine.busy(borrow=True):
        engine.run(x)
        assert not engine.last_run_borrowed  # the other instance computes
    stop()
    with engine.busy(borrow=False):  # a window of several requests: the others may be about to compute
        engine.run(x)
        assert not engine.last_run_borrowed
    with engine.busy(borrow=True):
        wide = engine.run(x)["y"]
        assert engine.last_run_borrowed
    assert (engine.runs, engine.wide_runs) == (4, 1)
    np.testing.assert_allclose(wide, narrow, rtol=1e-5, atol=1e-5)
    engine.close()


def test_loading_lends_where_the_cores_are_split(tmp_path: Path, monkeypatch) -> None:
    from model_factory.backend.engines import loading
    from model_factory.backend.settings import parse_settings

    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    _two_layer_onnx(version / "model.onnx")
    monkeypatch.setattr(loading, "available_cpus", lambda: 2)
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path))
    two = {"name": "m", "instance_group": [{"kind": "KIND_CPU", "count": 2}]}
    engine, info = loading.load_engine(version, parse_settings(two), "CPU", 0, digests=None, server_instance=True)
    assert (info["threads"], info["wide_threads"]) == (1, 2) and engine.lends_cores
    engine.close()
    # accept, build's check and the queue bound's timing load outside a server: nothing to borrow from.
    engine, info = loading.load_engine(version, parse_settings(two), "CPU", 0, digests=None)
    assert info["wide_threads"] == 0 and not engine.lends_cores
    engine.close()
    off = dict(two, parameters={"lend_idle_cores": {"string_value": "false"}})
    engine, info = loading.load_engine(version, parse_settings(off), "CPU", 0, digests=None, server_instance=True)
    assert info["wide_threads"] == 0 and "lend_idle_cores = false" in info["lend_idle_cores"]
    assert not engine.lends_cores
    engine.close()
