"""Responses sent after execute() returns: every one, once, in order, even when a send fails."""

from __future__ import annotations

import threading

import pytest

from model_factory.backend.batching.deferred_responses import ResponseDispatcher


def test_every_response_reaches_its_own_sender_in_order_and_close_drains() -> None:
    got: list[tuple[str, str]] = []
    release = threading.Event()

    def send(sender: str, response: str) -> None:
        release.wait(5)  # held until every window is queued: close() must still send them all
        got.append((sender, response))

    d = ResponseDispatcher(send)
    d.dispatch(["a", "b"], ["ra", "rb"])
    d.dispatch(["c"], ["rc"])
    release.set()
    d.close()
    assert got == [("a", "ra"), ("b", "rb"), ("c", "rc")] and d.sent == 3 and d.failed == 0


def test_a_failed_send_is_logged_and_the_others_still_go() -> None:
    logged: list[str] = []
    got: list[str] = []

    def send(sender: str, response: str) -> None:
        if sender == "bad":
            raise RuntimeError("the client went away")
        got.append(sender)

    d = ResponseDispatcher(send, logged.append)
    d.dispatch(["a", "bad", "c"], [1, 2, 3])
    d.close()
    assert got == ["a", "c"] and d.failed == 1 and "the client went away" in logged[0]


def test_a_window_with_the_wrong_number_of_responses_is_refused() -> None:
    d = ResponseDispatcher(lambda s, r: None)
    with pytest.raises(ValueError, match="1 responses for 2 requests"):
        d.dispatch(["a", "b"], ["ra"])
    d.close()
