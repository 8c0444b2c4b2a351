"""A quiet start: the load at nice 19 in a thread of its own; the caller, and every thread that serves later, keep
their priority. Run in a child process each: a nice value, once raised, stays with the threads that have it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from model_factory.backend.engines.quiet_start import request_path, requested

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values per thread are Linux's")

_PRELUDE = """
import json, os, sys, threading
from model_factory.backend.engines.quiet_start import at_normal_priority, run_quietly

def nice():
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

def gone_after(before):
    # Python's join returns as the thread finishes; the kernel drops its task a moment later.
    import time
    for _ in range(100):
        left = sorted(set(threads()) - set(before))
        if not left:
            break
        time.sleep(0.01)
    return left

def new_threads(before):
    # The threads started since ``before`` and still there, once the finished quiet thread is gone from the kernel's
    # list (it lingers a moment after join; a lowered thread that serves never leaves, so it is still seen).
    import time
    for _ in range(100):
        new = {t: n for t, n in threads().items() if t not in before}
        if all(n == 0 for n in new.values()):
            break
        time.sleep(0.01)
    return new

def threads():
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:  # a thread that ends between the listing and the read is gone: not one of the threads asked about
            stat = open(f"/proc/self/task/{t}/stat").read()
        except FileNotFoundError:
            continue
        out[int(t)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out
"""


def _child(body: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PRELUDE + body, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_load_runs_at_nice_19_and_the_caller_keeps_its_priority() -> None:
    got = _child("""
seen = {}
def load():
    seen["load"] = nice()
    seen["normal"] = at_normal_priority(nice)  # handed to the worker the caller started
    seen["same_thread"] = threading.get_native_id() != at_normal_priority(threading.get_native_id)
    return 42
before = threads()
value, lowered = run_quietly(load)
print(json.dumps({"value": value, "lowered": lowered, "caller": nice(), "outside": at_normal_priority(nice),
                  "left": gone_after(before), **seen}))
""")
    assert got["value"] == 42 and got["lowered"] is True
    assert got["load"] == 19
    assert got["normal"] == got["caller"] == got["outside"] == 0
    assert got["same_thread"] is True  # at_normal_priority ran elsewhere, not in the quiet thread
    assert got["left"] == []  # the quiet thread and the worker are both gone


def test_an_error_in_the_load_is_raised_in_the_caller_and_no_thread_is_left() -> None:
    got = _child("""
before = threads()
try:
    run_quietly(lambda: 1 / 0)
    raised = None
except ZeroDivisionError as exc:
    raised = type(exc).__name__
print(json.dumps({"raised": raised, "left": gone_after(before), "caller": nice()}))
""")
    assert got == {"raised": "ZeroDivisionError", "left": [], "caller": 0}


def test_where_the_priority_cannot_be_lowered_the_load_still_runs() -> None:
    got = _child("""
value, lowered = run_quietly(lambda: nice(), lower=lambda: False)
print(json.dumps({"value": value, "lowered": lowered}))
""")
    assert got == {"value": 0, "lowered": False}


def _tiny_onnx(path: Path) -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_an_engine_loaded_quietly_keeps_its_serving_threads_at_the_normal_priority(tmp_path: Path) -> None:
    """The one-thread session computes on the caller's thread; the wide session's intra-op pool (which serves
    borrowed runs later) is made by the normal-priority worker, so its threads are not lowered."""
    _tiny_onnx(tmp_path / "m.onnx")
    got = _child("""
import onnxruntime  # as in the stub's load: whatever importing it starts is not a serving thread
import numpy as np
from model_factory.backend.engines.onnxruntime import OnnxRuntimeEngine
from model_factory.backend.batching.idle_cores import BusyLedger
before = threads()
engine, lowered = run_quietly(lambda: OnnxRuntimeEngine(sys.argv[1] + "/m.onnx", threads=1, wide_threads=2,
                                                       ledger=BusyLedger(sys.argv[1] + "/ledger")))
new = new_threads(before)
y = engine.run({"x": np.ones((2, 64), np.float32)})
print(json.dumps({"lowered": lowered, "new": list(new.values()), "caller": nice(),
                  "ok": bool(np.allclose(y["y"] if isinstance(y, dict) else y[0], 64.0))}))
""", str(tmp_path))
    assert got["lowered"] is True and got["ok"] is True and got["caller"] == 0
    assert got["new"] and all(n == 0 for n in got["new"]), got  # the wide session's pool: normal priority



def test_a_session_loaded_quietly_is_initialized_on_the_quiet_thread(tmp_path: Path) -> None:
    """The C++ session (whose constructor starts the intra-op pool) is made by the normal-priority worker; its
    initialization (the weights read, the graph optimized, the weights packed: nearly all of the load's CPU time)
    runs on the quiet thread. Seen through onnxruntime's own two steps, each recording its thread's nice value."""
    _tiny_onnx(tmp_path / "m.onnx")
    got = _child("""
import onnxruntime
import numpy as np
from onnxruntime.capi import _pybind_state as c_api
from model_factory.backend.engines.onnxruntime import OnnxRuntimeEngine

seen = {}
real = c_api.InferenceSession

class Spy:
    def __init__(self, *args):
        seen["made"] = nice()
        self._real = real(*args)

    def initialize_session(self, *args):
        seen["initialized"] = nice()
        return self._real.initialize_session(*args)

    def __getattr__(self, name):
        return getattr(self._real, name)

c_api.InferenceSession = Spy
before = threads()
engine, lowered = run_quietly(lambda: OnnxRuntimeEngine(sys.argv[1] + "/m.onnx", threads=2))
new = new_threads(before)
y = engine.run({"x": np.ones((2, 64), np.float32)})
print(json.dumps({"lowered": lowered, "seen": seen, "pool": list(new.values()), "caller": nice(),
                  "ok": bool(np.allclose(y["y"] if isinstance(y, dict) else y[0], 64.0))}))
""", str(tmp_path))
    assert got["lowered"] is True and got["ok"] is True and got["caller"] == 0
    assert got["seen"] == {"made": 0, "initialized": 19}, got
    assert got["pool"] and all(n == 0 for n in got["pool"]), got  # the pool's thread: normal priority


def test_the_rollout_asks_for_it_with_a_file_per_model(tmp_path: Path) -> None:
    assert not requested(tmp_path, "m") and not requested(None, "m")
    request_path(tmp_path, "m").write_text("")
    assert requested(tmp_path, "m") and not requested(tmp_path, "other")
    assert request_path(tmp_path, "m").name == "m.quiet"


def _tiny_causal_lm(path: Path) -> None:
    """A graph with a text-generation graph's two required inputs (CausalLM checks their names); enough to make a
    session of."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["f"], to=TensorProto.FLOAT),
         helper.make_node("Unsqueeze", ["f", "axes"], ["logits"])], "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["n", "s"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["n", "t"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", "s", 1])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_a_text_generation_graph_loaded_quietly_keeps_its_pool_at_the_normal_priority(tmp_path: Path) -> None:
    """generate_model's quiet load makes its CausalLM on the quiet thread: the session's intra-op pool (which
    computes every later step with the engine loop) is made by the normal-priority worker."""
    _tiny_causal_lm(tmp_path / "lm.onnx")
    got = _child("""
import onnxruntime
from model_factory.backend.generation.causal_lm import CausalLM
before = threads()
lm, lowered = run_quietly(lambda: CausalLM(sys.argv[1] + "/lm.onnx", threads=2))
new = new_threads(before)
print(json.dumps({"lowered": lowered, "new": list(new.values()), "caller": nice(),
                  "inputs": list(lm.input_names)}))
""", str(tmp_path))
    assert got["lowered"] is True and got["caller"] == 0
    assert got["inputs"] == ["input_ids", "attention_mask"]
    assert got["new"] and all(n == 0 for n in got["new"]), got  # the pool's thread(s): normal priority
