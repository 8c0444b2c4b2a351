"""Decision events alone: the token bucket, request ids, input hashes and the JSON lines written."""

from __future__ import annotations

import json
import time

import numpy as np

from model_factory.backend.operations.events import EventLog, TokenBucket, input_hash, request_id


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_bucket_lets_a_burst_through_then_the_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=2.0, burst=5.0, clock=clock)
    assert sum(bucket.take() for _ in range(100)) == 5
    clock.now = 10.0  # refills to the burst, not beyond
    assert sum(bucket.take() for _ in range(100)) == 5
    clock.now = 11.0
    assert sum(bucket.take() for _ in range(100)) == 2


def test_request_id_prefers_the_kserve_id_then_the_header_then_generates() -> None:
    assert request_id("abc", '{"X-Request-ID": "hdr"}') == ("abc", "client")
    assert request_id("", '{"X-Request-ID": "hdr", "long_inputs": "chunk"}') == ("hdr", "header")
    assert request_id("", {"x-request-id": "grpc-hdr"}) == ("grpc-hdr", "header")  # gRPC metadata: lower case
    rid, source = request_id(None, "")
    assert source == "generated" and len(rid) == 16 and rid != request_id(None, None)[0]


def test_input_hash_is_stable_and_tells_inputs_apart() -> None:
    text = np.array([[b"a secret sentence"]], dtype=object)
    assert input_hash([text]) == input_hash([np.array([[b"a secret sentence"]], dtype=object)])
    assert input_hash([text]) != input_hash([np.array([[b"another one"]], dtype=object)])
    assert input_hash([np.arange(4)]) != input_hash([np.arange(4).reshape(2, 2)])  # the shape counts
    assert len(input_hash(["x"])) == 16


def test_events_are_json_lines_and_the_dropped_ones_are_said(tmp_path) -> None:
    clock = Clock()
    path = tmp_path / "events.jsonl"
    log = EventLog("m", "m_0", path=str(path), rate=1.0, burst=2.0, clock=clock)
    calls = []
    for i in range(10):
        log.emit("input_refused", lambda i=i: calls.append(i) or {"request_id": f"r{i}"})
    assert calls == [0, 1]  # the fields are built only for events written
    clock.now = 1.0
    log.emit("window_grouped", {"groups": [2]})
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in lines] == ["input_refused", "input_refused", "window_grouped"]
    assert lines[0]["model"] == "m" and lines[0]["instance"] == "m_0" and lines[0]["request_id"] == "r0"
    assert lines[2]["dropped"] == 8 and log.dropped_total == 8


def test_a_flood_with_no_event_after_it_says_its_dropped_count_once_the_bucket_refills(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog("m", path=str(path), rate=20.0, burst=2.0)  # a token every 50 ms
    for i in range(10):
        log.emit("input_refused", {"request_id": f"r{i}"})
    deadline = time.monotonic() + 5
    while "events_dropped" not in path.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # a second timer would have written by now
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in lines] == ["input_refused", "input_refused", "events_dropped"]
    assert lines[2]["dropped"] == 8 and log.dropped == 0 and log.dropped_total == 8


def test_closing_the_log_cancels_a_pending_dropped_event(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog("m", path=str(path), rate=5.0, burst=1.0)
    log.emit("a", {})
    log.emit("b", {})  # dropped: an events_dropped event pending for 200 ms
    log.close()
    time.sleep(0.4)
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["a"]


def test_an_event_that_cannot_be_written_fails_nothing() -> None:
    def broken(_line: str) -> None:
        raise OSError("disk full")

    assert EventLog("m", sink=broken).emit("x", {}) is False
