"""The rollout's pieces that need no server: the request's checks, the switch's configuration, the tallies summed
(the rollout itself runs on the real server: tests/integration/test_rollout_serving.py)."""

from __future__ import annotations

import json

import pytest

from model_factory.errors import FactoryError
from model_factory.serving.rollout import RolloutRequest, candidate_config, summed_tallies, version_config


def test_a_request_needs_model_and_version_and_sane_gate_values() -> None:
    req = RolloutRequest.from_dict({"model": "m", "version": "3", "gate": 0.95, "min_requests": 10})
    assert (req.model, req.version, req.gate, req.min_requests, req.share) == ("m", 3, 0.95, 10, 1.0)
    with pytest.raises(FactoryError, match="model and version"):
        RolloutRequest.from_dict({"model": "m"})
    with pytest.raises(FactoryError, match="share must be"):
        RolloutRequest.from_dict({"model": "m", "version": 2, "share": 0})


def test_the_switch_serves_one_version_under_instance_names_of_its_own() -> None:
    base = {"name": "m", "version_policy": {"specific": {"versions": [1]}},
            "instance_group": [{"count": 2, "kind": "KIND_CPU"}]}
    cfg = version_config(base, 2)
    assert cfg["version_policy"] == {"specific": {"versions": [2]}}
    assert cfg["instance_group"] == [{"count": 2, "kind": "KIND_CPU", "name": "m_v2_0"}]
    assert base["instance_group"] == [{"count": 2, "kind": "KIND_CPU"}]  # the base is not changed
    cand = version_config(base, 2, "m__candidate")
    assert cand["name"] == "m__candidate" and cand["instance_group"][0]["name"] == "m__candidate_v2_0"
    from model_factory.build.repository import config_to_pbtxt  # Triton's schema accepts it

    assert 'name: "m_v2_0"' in config_to_pbtxt(cfg)


def test_a_text_generation_candidate_loads_non_decoupled_and_the_served_config_stays_decoupled() -> None:
    base = {"name": "lm", "backend": "python", "model_transaction_policy": {"decoupled": True},
            "instance_group": [{"count": 1, "kind": "KIND_CPU"}]}
    cand = candidate_config(base, 3, "lm__candidate")
    assert cand["model_transaction_policy"] == {"decoupled": False}
    assert cand["name"] == "lm__candidate" and cand["version_policy"] == {"specific": {"versions": [3]}}
    assert cand["instance_group"][0]["name"] == "lm__candidate_v3_0"
    assert base["model_transaction_policy"] == {"decoupled": True}  # the served model's config is not touched
    assert version_config(base, 3)["model_transaction_policy"] == {"decoupled": True}  # nor its switch
    encoder = {"name": "m", "backend": "python", "max_batch_size": 8}
    assert "model_transaction_policy" not in candidate_config(encoder, 2, "m__candidate")


def test_tallies_of_the_same_rollout_are_summed_over_instances(tmp_path) -> None:
    def write(instance: str, rollout: str, mirrored: int, total: float, low: float, worst: list) -> None:
        (tmp_path / f"m.{instance}.tally.json").write_text(json.dumps(
            {"id": rollout, "mirrored": mirrored, "score_sum": total, "min_score": low, "errors": 0, "skipped": 1,
             "worst": [{"score": s, "input_hash": h} for s, h in worst]}))

    write("m_0_0", "r1", 3, 2.5, 0.5, [(0.5, "a"), (1.0, "b")])
    write("m_0_1", "r1", 2, 1.9, 0.9, [(0.9, "c")])
    write("m_0_2", "old", 9, 0.0, 0.0, [(0.0, "z")])  # an earlier rollout's tally: not counted
    t = summed_tallies(tmp_path, "m", "r1")
    assert t["mirrored"] == 5 and t["skipped"] == 2 and abs(t["score_sum"] - 4.4) < 1e-9 and t["min_score"] == 0.5
    assert [w["input_hash"] for w in t["worst"]] == ["a", "c", "b"]


def test_a_rollout_whose_outcome_is_final_is_waited_for_not_refused_while_it_cleans_up() -> None:
    """A rollout's status turns final (rolled_back, switched) before its thread has unloaded the candidate; the
    next rollout or undo waits for that cleanup instead of answering "a rollout is in progress" (the fresh-clone CI
    run caught it). One still in progress is not waited for."""
    import threading
    import time

    from model_factory.serving.rollout import RolloutControl, RolloutStatus

    control = object.__new__(RolloutControl)  # only the fields the wait reads; no server
    status = RolloutStatus("r1", "m", 2, 1, state="rolled_back")
    control.statuses = {"m": status}
    control._running = threading.Thread(target=time.sleep, args=(0.5,))  # the candidate's unload
    control._running.start()
    control._await_cleanup(timeout_s=10)
    assert not control._running.is_alive()
    status.state = "shadowing"  # still deciding: the caller refuses at once, it does not wait
    control._running = threading.Thread(target=time.sleep, args=(3,))
    control._running.start()
    began = time.monotonic()
    control._await_cleanup(timeout_s=10)
    assert control._running.is_alive() and time.monotonic() - began < 1


def test_the_rollout_thread_yields_the_cores_and_leaves_the_others_as_they_were() -> None:
    import os
    import threading

    from model_factory.backend.idle_cores import yield_cores as _yield_cores

    seen = {}

    def body() -> None:
        _yield_cores()
        seen["rollout"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen["rollout"] == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # this thread: unchanged
