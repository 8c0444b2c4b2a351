"""The build log reads like a tool's output: one plain line per message, no source column, no wrapping."""

from __future__ import annotations

import io
import re

from model_factory.cli.common import progress_printer
from model_factory.progress import Steps, heartbeat


def test_log_file_gets_plain_unwrapped_lines() -> None:
    out = io.StringIO()  # not a terminal: a log file, a pipe, CI
    say = progress_printer(out)
    long_path = "/very/long/" + "nested-folder/" * 12 + "model.onnx"
    say("[export] started")
    say(f"loading {long_path}")
    say("table line 1\ntable line 2")
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"\d\d:\d\d:\d\d \[export\] started", lines[0])
    assert lines[1].endswith(f"loading {long_path}")  # the path is whole, on one line
    assert lines[2:] == ["table line 1", "table line 2"]
    assert ".py:" not in out.getvalue()  # no source-file column (it used to say common.py:38)


def test_steps_report_about_a_tenth_at_a_time_and_the_end() -> None:
    said: list[str] = []
    steps = Steps(said.append, "sensitivity", 25)
    for _ in range(25):
        steps.step()
    counts = [int(re.search(r": (\d+)/25", m).group(1)) for m in said]
    assert counts == [3, 6, 9, 12, 15, 18, 21, 24, 25]


def test_heartbeat_speaks_while_a_long_call_runs() -> None:
    import threading

    said: list[str] = []
    spoke = threading.Event()

    def say(msg: str) -> None:
        said.append(msg)
        spoke.set()

    with heartbeat(say, "building the fp16 engine", every=0.01):
        assert spoke.wait(5)  # waits for the event, not for a fixed time
    n = len(said)
    assert said[0].startswith("building the fp16 engine: still running (")
    assert len(said) == n  # stopped with the block
