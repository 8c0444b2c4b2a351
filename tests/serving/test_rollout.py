"""The rollout's pieces that need no server: the request's checks, the switch's configuration, the tallies summed
(the rollout itself runs on the real server: tests/integration/test_rollout_serving.py)."""

from __future__ import annotations

import json

import pytest

from model_factory.errors import FactoryError
from model_factory.serving.rollout_candidate import candidate_config
from model_factory.serving.rollout_mirror import summed_tallies
from model_factory.serving.rollout_plan import RolloutRequest, switch_plan, version_config


def test_a_request_needs_model_and_version_and_sane_gate_values() -> None:
    req = RolloutRequest.from_dict({"model": "m", "version": "3", "gate": 0.95, "min_requests": 10})
    assert (req.model, req.version, req.gate, req.min_requests, req.share) == ("m", 3, 0.95, 10, 1.0)
    with pytest.raises(FactoryError, match="model and version"):
        RolloutRequest.from_dict({"model": "m"})
    with pytest.raises(FactoryError, match="share must be"):
        RolloutRequest.from_dict({"model": "m", "version": 2, "share": 0})


def test_the_switch_names_its_versions_and_instance_names_of_their_own() -> None:
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
    both = version_config(base, [2, 1])  # the switch: the previous version kept beside the new one
    assert both["version_policy"] == {"specific": {"versions": [1, 2]}}
    assert both["instance_group"][0]["name"] == "m_v2_0"  # the new instances' names; version 1 keeps its own


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

    from model_factory.serving.rollout import RolloutControl
    from model_factory.serving.rollout_plan import RolloutStatus

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

    from model_factory.backend.batching.idle_cores import yield_cores as _yield_cores

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



def test_the_rollout_check_hashes_at_the_lowest_priority_and_its_refusal_reaches_the_caller(tmp_path) -> None:
    """``start`` verifies the whole version (hashing every file) before it answers: that runs on a nice-19 thread
    (the control endpoint's own thread keeps its priority), and a refusal is raised in the caller as before."""
    import os
    import threading

    from model_factory.serving.rollout import RolloutControl
    from model_factory.serving.rollout_plan import RolloutRequest

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    control = RolloutControl(_Server(tmp_path), None, ["m"])
    seen = []

    def check(req):
        seen.append(priority())
        raise FactoryError(f"refused: {req.model} {req.version} is not released")

    control.check = check
    before = priority()
    with pytest.raises(FactoryError, match="refused: m 2 is not released"):
        control.start(RolloutRequest("m", 2))
    assert seen == [19] and priority() == before
    control.close()


class _Server:
    """What RolloutControl asks of the server, with each load's version policy recorded (no Triton)."""

    def __init__(self, tmp_path) -> None:
        self.repository = tmp_path
        self.work_dir = tmp_path
        self.load_configs = {"m": json.dumps({"name": "m", "version_policy": {"specific": {"versions": [1]}},
                                              "instance_group": [{"count": 1, "kind": "KIND_CPU"}]})}
        self.loads: list[list[int]] = []

    def load_model(self, name: str, timeout_s=None):
        self.loads.append(json.loads(self.load_configs[name])["version_policy"]["specific"]["versions"])
        return None


def test_the_previous_version_stays_loaded_for_the_grace_period_then_is_unloaded(tmp_path) -> None:
    """The switch names both versions (Triton keeps the loaded one, serves the highest); at the end of the grace
    period the previous one is dropped from the policy (unloaded); an undo before then names it alone."""
    import time

    from model_factory.serving.rollout import RolloutControl
    from model_factory.serving.rollout_plan import Switched

    server = _Server(tmp_path)
    control = RolloutControl(server, None, ["m"])
    assert control.serving == {"m": 1}
    control._switch("m", [1, 2])
    assert server.loads == [[1, 2]] and control.serving == {"m": 2}
    done = Switched("m", 1, 2, time.time() + 0.3)
    control.switched["m"] = done
    control._end_grace_at(done)
    deadline = time.monotonic() + 10
    while "m" in control.switched and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    assert server.loads == [[1, 2], [2]] and control.serving == {"m": 2}
    with pytest.raises(FactoryError, match="no rollout of m to undo"):
        control.undo("m")

    control._switch("m", [2, 3])  # the next rollout: version 2 kept, then undone before its grace period ends
    done = Switched("m", 2, 3, time.time() + 0.5)
    control.switched["m"] = done
    control._end_grace_at(done)
    status = control.undo("m")
    assert status.state == "undone" and control.serving == {"m": 2}
    time.sleep(0.8)  # past the grace period: nothing more is loaded
    assert server.loads == [[1, 2], [2], [2, 3], [2]]
    assert json.loads(server.load_configs["m"])["version_policy"] == {"specific": {"versions": [2]}}
    control.close()


def test_the_previous_version_is_kept_only_when_the_new_configuration_differs_in_what_triton_compares_away() -> None:
    """One Triton model has one configuration for every loaded version; Triton reloads a kept version when the
    configuration changes in more than the version policy and the instance groups' names."""
    serving = version_config({"name": "m", "max_batch_size": 64, "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
                              "parameters": {"onnx_file": {"string_value": "model.onnx"}}}, 1)
    same = {"name": "m", "max_batch_size": 64, "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
            "parameters": {"onnx_file": {"string_value": "model.onnx"}},
            "version_policy": {"specific": {"versions": ["3"]}}}
    assert switch_plan(serving, same, 1, 2, 600.0) == ([1, 2], True)
    assert switch_plan(serving, same, 1, 2, 0.0) == ([2], False)  # no grace period: nothing kept
    int8 = dict(same, parameters={"onnx_file": {"string_value": "model.int8.onnx"}})  # another engine file
    assert switch_plan(serving, int8, 1, 2, 600.0) == ([2], False)
    more = dict(same, instance_group=[{"count": 4, "kind": "KIND_CPU"}])  # other instances: v1's would change
    assert switch_plan(serving, more, 1, 2, 600.0) == ([2], False)


def test_a_rollout_judged_by_its_acceptance_says_so_in_place_of_a_mirror_count() -> None:
    """A prompt template or a LoRA adapter is not mirrored: ``model-factory rollout`` prints what judged it, not
    ``mirrored 0/50, agreement -``; a model's line keeps its mirror count and agreement."""
    from model_factory.cli.rollout import _line
    from model_factory.serving.rollout_plan import RolloutStatus

    judged = RolloutStatus("r1", "support", 2, 1, state="switched", judged_by="acceptance",
                           accepted="passed: its build's gate", gate=0.99, min_requests=50).to_dict()
    assert _line(judged) == ("support 1 -> 2: switched, not mirrored (its acceptance is its gate: passed: its build's "
                             "gate)")
    waiting = RolloutStatus("r1", "triage", 2, 1, state="accepting", judged_by="acceptance").to_dict()
    assert _line(waiting) == "triage 1 -> 2: accepting, not mirrored (its acceptance is its gate)"
    mirrored = RolloutStatus("r2", "m", 2, 1, state="shadowing", mirrored=3, gate=0.99, min_requests=50).to_dict()
    assert _line(mirrored) == "m 1 -> 2: shadowing, mirrored 3/50, agreement - (lowest -, gate 0.99)"
