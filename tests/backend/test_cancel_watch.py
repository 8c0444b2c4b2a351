"""The cancellation watcher asks each watched request off the engine loop and keeps the answer: a flag reads what
the last round heard, a cancelled or closed request is asked no more, a failing question is logged once and
read as "not cancelled", and the thread's own rounds see a cancellation within its interval."""

from __future__ import annotations

import time

from model_factory.backend.generation.cancel_watch import CancelWatch


def _asker(answers: list[bool]):
    calls = {"n": 0}

    def ask() -> bool:
        calls["n"] += 1
        return answers[-1]

    return ask, calls


def test_a_flag_reads_the_last_round_and_a_cancelled_request_is_asked_no_more():
    watch = CancelWatch(interval_s=3600)  # rounds by hand
    try:
        answer = [False]
        ask, calls = _asker(answer)
        flag = watch.watch(ask)
        assert flag() is False and calls["n"] == 0  # reading asks nobody
        watch.poll()
        assert flag() is False and calls["n"] == 1
        answer.append(True)
        assert flag() is False  # not until a round asked
        watch.poll()
        assert flag() is True and watch.watched() == 0
        watch.poll()
        assert calls["n"] == 2
    finally:
        watch.close()


def test_a_closed_request_is_forgotten_and_a_failing_question_logs_once():
    logged: list[str] = []
    watch = CancelWatch(interval_s=3600, log_error=logged.append)
    try:
        answered_ask, answered_calls = _asker([False])
        answered = watch.watch(answered_ask)
        answered.close()

        def broken() -> bool:
            raise RuntimeError("stub lost its server")

        failing = watch.watch(broken)
        watch.poll()
        watch.poll()
        assert answered_calls["n"] == 0 and watch.watched() == 1
        assert failing() is False and len(logged) == 1 and "stub lost its server" in logged[0]
    finally:
        watch.close()


def test_the_thread_sees_a_cancellation_within_its_interval():
    watch = CancelWatch(interval_s=0.01)
    try:
        answer = [False]
        ask, _ = _asker(answer)
        flag = watch.watch(ask)
        answer.append(True)
        deadline = time.monotonic() + 5
        while not flag() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert flag() is True
    finally:
        watch.close()
    assert not watch._thread.is_alive()


def test_close_waits_for_a_question_in_flight_and_none_is_asked_after_it():
    """A request must never be asked once its final response may be out (Triton frees it then: asking crashes
    the server), so close() waits for the watcher's question in flight."""
    import threading

    watch = CancelWatch(interval_s=3600)
    try:
        asking, release, after_close = threading.Event(), threading.Event(), []
        closed = threading.Event()

        def slow_ask() -> bool:
            if closed.is_set():
                after_close.append(True)
            asking.set()
            release.wait(5)
            return False

        flag = watch.watch(slow_ask)
        poller = threading.Thread(target=watch.poll)
        poller.start()
        assert asking.wait(5)
        closer = threading.Thread(target=lambda: (flag.close(), closed.set()))
        closer.start()
        closer.join(0.2)
        assert closer.is_alive() and not closed.is_set()  # held while the question is in flight
        release.set()
        closer.join(5)
        poller.join(5)
        assert closed.is_set()
        watch.poll()
        assert flag.ask() is False and not after_close and watch.watched() == 0
    finally:
        watch.close()
