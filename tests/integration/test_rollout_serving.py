"""model-factory rollout on the real Triton, under steady load from a client pool: v1 -> v2 switched with no
failed request (every request sent after the switch answered by v2), --undo back to v1 with none failed, a
disagreeing (perturbed, re-signed, released) v3 rolled back by the shadow gate while v1 keeps serving, and
the refusals (older, unsigned, not released) as one line and exit 1. The switch loads v2 quietly (its load at
the lowest CPU priority, the stubs' serving threads at the normal one)."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest

from tests.release_policy import released_policy
from tests.request_load import RequestLoad

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("tuf", reason="pip install 'model-factory[sign]' (python-tuf)")

MODEL = "roll"
KEY = "rollout-test-admin-key-0123456789"


@dataclass
class Env:
    repo: Path
    model_dir: Path
    server: object
    control: object
    endpoint: object
    key_file: Path
    keys: object
    release_keys: list
    healed: list = field(default_factory=list)  # stubs healed: Triton 2.51 then never finishes that unload


@pytest.fixture(scope="module")
def env(tmp_path_factory, minilm_recipe, minilm_export, package_signed):
    """Serving v1 of a released model; v2 (same weights) and v3 (other weights, its own golden data) packaged,
    signed and released while it serves; a control endpoint as ``serve --control-port`` starts it."""
    from model_factory.build_engines.golden import write_acceptance_data
    from model_factory.serving.control_api import ControlServer
    from model_factory.serving.rollout import RolloutControl
    from model_factory.serving.server import ServerOptions, start_verified_server
    from model_factory.signing import generate_keypair
    from model_factory.signing.release import add_release
    from tests.conftest import _other_weights

    root = tmp_path_factory.mktemp("rollout")
    repo = root / "repo"
    keys = generate_keypair(root / "keys")
    recipe = replace(minilm_recipe, name=MODEL, repository=replace(minilm_recipe.repository, path=repo))
    fp32 = minilm_export.onnx_path
    golden = write_acceptance_data(recipe, fp32, minilm_export.tokenizer_dir, root / "golden")
    model_dir = package_signed(recipe, keys, acceptance_dir=golden)
    policy, k = released_policy(repo, keys, root)

    server, report = start_verified_server(repo, ServerOptions(0, 0, 0, admin_key=KEY), policy,
                                           log_file=root / "tritonserver.log")
    env_healed = False
    try:
        assert report.served == (MODEL,), report.refused
        control = RolloutControl(server, report.digests, report.served, poll_s=0.1)
        endpoint = ControlServer(control, server.admin_key).start()
        # While v1 serves: v2 (the same model rebuilt) and v3 (other weights, self-consistent golden data).
        package_signed(replace(recipe, version=2), keys, acceptance_dir=golden)
        other = _other_weights(fp32, root / "other.onnx")
        golden_bad = write_acceptance_data(recipe, other, minilm_export.tokenizer_dir, root / "golden-bad")
        package_signed(replace(recipe, version=3), keys, {"model.onnx": other}, acceptance_dir=golden_bad)
        assert add_release(repo, k, k, k) == 2
        key_file = root / "admin-key"
        key_file.write_text(KEY + "\n")
        env = Env(repo, model_dir, server, control, endpoint, key_file, keys, k)
        yield env
        env_healed = bool(env.healed)
        endpoint.stop()
    finally:
        rc = server.stop()
        # Triton 2.51 never finishes the unload of an instance whose stub died (docs/operations.md, "Lifetimes"):
        # after a heal the server's exit takes the exit timeout and returns 1.
        assert rc == 0 or (rc == 1 and env_healed), (rc, server.log_tail(60))


class Load(RequestLoad):
    """Clients that send requests back to back until stopped: (sent, answered, outcome, model_version)."""

    def __init__(self, url: str, clients: int = 3) -> None:
        super().__init__(url, clients)
        texts = Path(__file__).resolve().parents[2] / "model_factory" / "examples" / "heldout.txt"
        self.texts = [t for t in texts.read_text().splitlines() if t.strip()][:64]

    def connect(self, i: int):
        import tritonclient.http as httpclient

        return httpclient.InferenceServerClient(self.url, network_timeout=120)

    def disconnect(self, client) -> None:
        client.close()

    def request(self, client, i: int, n: int) -> tuple[str, str | None]:
        import tritonclient.http as httpclient

        inp = httpclient.InferInput("text", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[self.texts[(i + 7 * n) % len(self.texts)].encode()]], dtype=np.object_))
        return "ok", client.infer(MODEL, [inp]).get_response().get("model_version")


def _rollout(env: Env, *args: str):
    from click.testing import CliRunner

    from model_factory.cli.main import main

    return CliRunner().invoke(main, ["rollout", MODEL, *args, "--serve-url", env.endpoint.url,
                                     "--admin-key-file", str(env.key_file)])


def _index(env: Env) -> dict[str, str]:
    return {f"{m['name']}/{m.get('version', '')}": m.get("state", "") for m in env.server.model_status()}


def test_refusals_are_one_line_and_exit_1(env: Env) -> None:
    from model_factory.signing import SignerConfig, sign_model_version

    older = _rollout(env, "1")
    assert older.exit_code == 1 and "not newer than the serving version 1" in older.output, older.output
    shutil.copytree(env.model_dir / "2", env.model_dir / "5")  # a version folder nobody signed
    try:
        unsigned = _rollout(env, "5")
        assert unsigned.exit_code == 1 and "refused:" in unsigned.output and "5" in unsigned.output, unsigned.output
        sign_model_version(env.model_dir, 5, SignerConfig(env.keys.private_key))  # signed, in no release
        unreleased = _rollout(env, "5")
        assert unreleased.exit_code == 1 and "not released" in unreleased.output, unreleased.output
    finally:
        shutil.rmtree(env.model_dir / "5")
        for sig in env.model_dir.glob("5.*sig"):
            sig.unlink()
    for result in (older, unsigned, unreleased):
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert "Traceback" not in result.output
    assert env.control.status(MODEL) is None  # nothing started, nothing loaded
    from model_factory.serving.control_api import call

    assert call(env.endpoint.url, "not-the-admin-key-000", "POST", "/v1/rollouts",
                {"model": MODEL, "version": 2})[0] == 403
    assert call(env.endpoint.url, "", "GET", f"/v1/rollouts/{MODEL}")[0] == 403
    assert not any(k.startswith(MODEL + "__candidate") for k in _index(env))


def _stub_main_threads(instance_prefix: str) -> dict[int, int]:
    """{stub pid: nice value of its main thread (the one that runs execute())} for the instances named so."""

    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"triton_python_backend_stub" in argv[0] and any(a.startswith(instance_prefix.encode()) for a in argv):
                out[int(pid)] = os.getpriority(os.PRIO_PROCESS, int(pid))
        except OSError:
            continue
    return out


def _stubs_by_version(env: Env) -> dict[str, set[int]]:
    from model_factory.serving.supervise import stub_pids_by_version

    return stub_pids_by_version(env.server.process.pid, env.server.served_repository, MODEL)


def test_switch_under_load_loses_no_request_and_undo_returns_to_v1(env: Env) -> None:
    """v1 stays loaded through the grace period: the switch loads v2 beside it (v1's stubs are the same
    processes) and the undo only unloads v2."""
    v1_stubs = _stubs_by_version(env)["1"]
    with Load(env.server.http_url) as load:
        before = len(load.results)
        result = _rollout(env, "2", "--min-requests", "30", "--gate", "0.99")
        switched_at = time.monotonic()
        v2_stubs = _stub_main_threads(f"{MODEL}_v2_")
        in_grace = _stubs_by_version(env)
        index_in_grace = _index(env)
        time.sleep(2.0)
        after_switch = len(load.results)
        undo = _rollout(env, "--undo")
        undone_at = time.monotonic()
        time.sleep(2.0)
    deadline = time.monotonic() + 60  # v2's stubs end once the requests they hold are answered
    while set(after_undo := _stubs_by_version(env)) != {"1"} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert result.exit_code == 0, result.output
    assert "switched in" in result.output
    status = env.control.status(MODEL)
    assert status.mirrored >= 30 and status.agreement >= 0.99 and status.candidate_errors == 0
    assert load.failed() == [], load.failed()[:3]
    assert before > 0 and all(r[3] == "1" for r in load.results[:before])
    sent_after = [r for r in load.results[:after_switch] if r[0] > switched_at]
    assert sent_after and all(r[3] == "2" for r in sent_after), {r[3] for r in sent_after}
    assert undo.exit_code == 0, undo.output
    assert "undone" in undo.output
    sent_after_undo = [r for r in load.results if r[0] > undone_at]
    assert sent_after_undo and all(r[3] == "1" for r in sent_after_undo), {r[3] for r in sent_after_undo}
    assert status.state == "undone"
    # The switch loaded v2 quietly (nice 19 in a thread of its own); each v2 stub's serving thread kept its priority.
    log = env.server.log_file.read_text(errors="replace")
    quiet = [line for line in log.splitlines() if "model-factory backend: roll serves" in line and "load quiet" in line]
    assert len(quiet) == 2 and all("load quiet (nice 19)" in line for line in quiet), quiet
    assert len(v2_stubs) == 2 and set(v2_stubs.values()) == {os.nice(0)}, v2_stubs
    # Nothing of v1 was loaded again: not at the switch (it stayed loaded beside v2), not at the undo.
    assert in_grace["1"] == v1_stubs and len(in_grace["2"]) == 2, (v1_stubs, in_grace)
    assert index_in_grace[f"{MODEL}/1"] == index_in_grace[f"{MODEL}/2"] == "READY", index_in_grace
    assert after_undo == {"1": v1_stubs}, (v1_stubs, after_undo)
    index = _index(env)
    assert not any(k.startswith(MODEL + "__candidate") and v == "READY" for k, v in index.items()), index
    print(f"\nrollout v1->v2: {len(load.results)} requests, 0 failed; {result.output.strip()}\n{undo.output.strip()}")


def test_a_dead_stub_in_the_grace_period_reloads_its_version_alone(env: Env) -> None:
    """Through the grace period (v1 kept beside v2) one of v2's stubs is killed: the stub watch unloads v2 alone
    (v1's stubs are the same processes throughout, and answer meanwhile), verifies it again and loads it anew;
    requests sent once it is healed are answered by v2. Then undone to v1 for the tests after this one."""
    import signal

    from model_factory.serving.supervise import StubWatch, pid_alive

    messages: list[str] = []
    try:
        with Load(env.server.http_url) as load:  # traffic for the shadow, then through the heal
            result = _rollout(env, "2", "--min-requests", "20")
            assert result.exit_code == 0, result.output
            stubs = _stubs_by_version(env)
            assert set(stubs) == {"1", "2"} and len(stubs["2"]) == 2, stubs
            watch = StubWatch(env.server, [MODEL], echo=messages.append)  # settle_s: the default 5 s
            assert watch.expected == {MODEL: 2} and watch.check() == []
            victim = min(stubs["2"])
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while pid_alive(victim) and time.monotonic() < deadline:
                time.sleep(0.02)
            recoveries = watch.check()
            env.healed.extend(recoveries)
            healed_at = time.monotonic()
            time.sleep(2.0)
        after = _stubs_by_version(env)
        index = _index(env)
    finally:
        undo = _rollout(env, "--undo")
        deadline = time.monotonic() + 60
        while set(_stubs_by_version(env)) != {"1"} and time.monotonic() < deadline:
            time.sleep(0.2)
    assert [r.ok for r in recoveries] == [True], (recoveries, messages)
    assert any("version 2 died; version 1 keeps serving" in m for m in messages), messages
    assert after["1"] == stubs["1"], (stubs, after)  # v1 was never unloaded nor loaded again
    assert len(after["2"]) == 2 and not after["2"] & stubs["2"], (stubs, after)  # v2's stubs are new
    assert index[f"{MODEL}/1"] == index[f"{MODEL}/2"] == "READY", index
    sent_after = [r for r in load.results if r[0] > healed_at]
    assert sent_after and all(r[2] == "ok" and r[3] == "2" for r in sent_after), sent_after[:3]
    # Only requests the dead stub held or was sent before v2 was unloaded can have failed.
    assert all(r[1] >= killed_at and r[0] < healed_at for r in load.failed()), load.failed()[:3]
    assert undo.exit_code == 0 and "undone" in undo.output, undo.output
    print(f"\nheal of v2 in the grace period: {recoveries[0].seconds:.1f} s, {len(load.failed())} of "
          f"{len(load.results)} requests failed (sent to the dead stub before v2 was unloaded)")


def test_a_disagreeing_candidate_is_rolled_back_and_v1_keeps_serving(env: Env) -> None:
    with Load(env.server.http_url) as load:
        result = _rollout(env, "3", "--min-requests", "20", "--gate", "0.99")
        time.sleep(1.0)
    assert result.exit_code == 1, result.output
    assert "rolled back" in result.output and "below the gate 0.99" in result.output, result.output
    status = env.control.status(MODEL)
    assert status.state == "rolled_back" and status.mirrored >= 20 and status.agreement < 0.99
    assert status.worst and all(len(w["input_hash"]) == 16 for w in status.worst)
    texts = set(load.texts)
    assert not any(t in result.output for t in texts)  # input hashes, never the text
    assert load.failed() == [], load.failed()[:3]
    assert load.results and all(r[3] == "1" for r in load.results)
    index = _index(env)
    assert not any(k.startswith(MODEL + "__candidate") and v == "READY" for k, v in index.items()), index
    assert not (Path(env.server.candidates_dir) / f"{MODEL}__candidate").exists()
    print(f"\nrolled back: agreement {status.agreement:.4f} over {status.mirrored}, worst {status.worst[:2]}")


def test_sigkill_of_the_rollout_command_changes_nothing_and_a_second_rollout_works(env: Env) -> None:
    """The rollout runs inside serve: its command killed outright mid-shadow leaves v1 serving (the candidate is
    judged and removed server-side; nothing half-switched), and the next rollout switches."""
    import signal
    import subprocess
    import sys

    with Load(env.server.http_url) as load:
        cmd = [sys.executable, "-m", "model_factory.cli.main", "rollout", MODEL, "3", "--serve-url", env.endpoint.url,
               "--admin-key-file", str(env.key_file), "--min-requests", "100000", "--timeout", "8"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "shadowing" in line:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert env.control.status(MODEL).state == "shadowing", seen
        deadline = time.monotonic() + 120
        while env.control.status(MODEL).state not in ("rolled_back", "failed") and time.monotonic() < deadline:
            time.sleep(0.2)
        first = env.control.status(MODEL)
        before_second = len(load.results)
        second = _rollout(env, "2", "--min-requests", "20")
        switched_at = time.monotonic()
        time.sleep(1.5)
    assert first.state == "rolled_back" and "not enough traffic" in first.reason, first
    assert load.failed() == [], load.failed()[:3]
    assert all(r[3] == "1" for r in load.results[:before_second])
    assert second.exit_code == 0, second.output
    sent_after = [r for r in load.results if r[0] > switched_at]
    assert sent_after and all(r[3] == "2" for r in sent_after)


def test_watch_rolls_out_a_newly_released_version_and_says_each_refusal_once(env: Env, minilm_recipe,
                                                                               minilm_export, package_signed) -> None:
    """``serve --watch`` and SIGHUP call ``RolloutControl.scan``: an unsigned new version is refused (said once,
    not again on the next look); once a newer version is packaged, signed and released, it is rolled out."""
    from model_factory.signing.release import add_release

    assert env.control.serving[MODEL] == 2  # the previous test switched to v2
    lines: list[str] = []
    env.control.echo = lines.append
    shutil.copytree(env.model_dir / "2", env.model_dir / "6")  # nobody signed it
    try:
        first = env.control.scan()
        again = env.control.scan()
        assert len(first) == 1 and "version 6 not rolled out: refused:" in first[0], first
        assert again == []  # the same refusal is not said twice
    finally:
        shutil.rmtree(env.model_dir / "6")
    recipe = replace(minilm_recipe, name=MODEL, version=4,
                     repository=replace(minilm_recipe.repository, path=env.repo))
    golden = env.model_dir / "1" / "acceptance"
    assert golden.is_dir()
    package_signed(recipe, env.keys, acceptance_dir=golden)
    add_release(env.repo, env.release_keys, env.release_keys, env.release_keys)
    with Load(env.server.http_url):
        started = env.control.scan()
        assert started == [f"watch: rolling out {MODEL} version 4 (serving 2)"], started
        assert env.control.scan() == []  # one rollout at a time
        deadline = time.monotonic() + 180
        while env.control.status(MODEL).state not in ("switched", "rolled_back", "failed") and \
                time.monotonic() < deadline:
            time.sleep(0.2)
    status = env.control.status(MODEL)
    assert status.state == "switched", status
    assert env.control.serving[MODEL] == 4
    assert env.control.scan() == []  # nothing newer


def test_a_version_with_another_configuration_replaces_the_previous_one_and_undo_loads_it_again(
        env: Env, minilm_recipe, package_signed) -> None:
    """One Triton model has one configuration for all its loaded versions: v5 packaged with another batching
    delay cannot serve beside v4 under one configuration, so the switch loads v5 alone, with its own
    configuration (before, a new version was loaded with the serving one's), and --undo loads v4 again with
    the configuration it served with. No request fails."""
    import json

    from model_factory.signing.release import add_release

    assert env.control.serving[MODEL] == 4  # the watch test switched to v4
    recipe = replace(minilm_recipe, name=MODEL, version=5, repository=replace(minilm_recipe.repository, path=env.repo),
                     batching=replace(minilm_recipe.batching, max_queue_delay_us=100))
    package_signed(recipe, env.keys, acceptance_dir=env.model_dir / "1" / "acceptance")
    add_release(env.repo, env.release_keys, env.release_keys, env.release_keys)
    v4_stubs = _stubs_by_version(env)["4"]
    with Load(env.server.http_url) as load:
        result = _rollout(env, "5", "--min-requests", "20")
        switched_at = time.monotonic()
        config_v5 = json.loads(env.server.load_configs[MODEL])
        time.sleep(1.5)
        undo = _rollout(env, "--undo")
        undone_at = time.monotonic()
        time.sleep(1.5)
    assert result.exit_code == 0 and "its configuration differs" in result.output, result.output
    assert config_v5["version_policy"] == {"specific": {"versions": [5]}}
    assert config_v5["dynamic_batching"].get("max_queue_delay_microseconds") in ("100", 100), config_v5
    assert undo.exit_code == 0 and "undone" in undo.output, undo.output
    config_v4 = json.loads(env.server.load_configs[MODEL])
    assert config_v4["version_policy"] == {"specific": {"versions": [4]}}
    assert not config_v4["dynamic_batching"].get("max_queue_delay_microseconds"), config_v4
    assert load.failed() == [], load.failed()[:3]
    sent_after = [r for r in load.results if switched_at < r[0] < switched_at + 1.5]
    assert sent_after and all(r[3] == "5" for r in sent_after), {r[3] for r in sent_after}
    after_undo = [r for r in load.results if r[0] > undone_at]
    assert after_undo and all(r[3] == "4" for r in after_undo), {r[3] for r in after_undo}
    assert _stubs_by_version(env).get("4", set()).isdisjoint(v4_stubs)  # v4 was loaded again


def test_the_serve_command_rolls_out_a_pulled_version_on_sighup(tmp_path, minilm_recipe, minilm_export,
                                                               package_signed) -> None:
    """``model-factory serve --control-port 0`` on a repository filled by ``model-factory pull``, end to end: the
    factory releases v2 and pushes it (an OCI layout: a registry or a USB disk alike), ``pull`` brings it with its
    release metadata into the served repository, SIGHUP rolls it out under load (0 failed),
    ``model-factory rollout --status`` reads it, ``--undo`` returns to v1 under load though the pull replaced v1's
    folder (v1 stayed loaded through the grace period), SIGTERM exits 0."""
    import re
    import signal
    import subprocess
    import sys

    from click.testing import CliRunner

    from model_factory.build_engines.golden import write_acceptance_data
    from model_factory.cli.main import main
    from model_factory.distribution.push_pull import push
    from model_factory.signing import generate_keypair
    from model_factory.signing.release import add_release

    factory = tmp_path / "factory"  # where models are built, signed and released
    served = tmp_path / "served"  # what serve reads: filled only by pull
    layout = tmp_path / "usb"
    keys = generate_keypair(tmp_path / "keys")
    recipe = replace(minilm_recipe, name=MODEL, repository=replace(minilm_recipe.repository, path=factory))
    golden = write_acceptance_data(recipe, minilm_export.onnx_path, minilm_export.tokenizer_dir, tmp_path / "golden")
    package_signed(recipe, keys, acceptance_dir=golden)
    policy, k = released_policy(factory, keys, tmp_path)

    def pull(tag: str) -> str:
        res = CliRunner().invoke(main, ["pull", f"oci-layout:{layout}:{tag}", str(served), "--policy", str(policy)])
        assert res.exit_code == 0, res.output
        return res.output

    push(factory, MODEL, f"oci-layout:{layout}:1")
    pull("1")
    assert (served / ".release" / "targets.json").read_bytes() == (factory / ".release" / "targets.json").read_bytes()
    key_file = tmp_path / "admin-key"
    key_file.write_text(KEY + "\n")
    cmd = [sys.executable, "-m", "model_factory.cli.main", "serve", "--policy", str(policy), "--admin-key-file",
           str(key_file), "--control-port", "0", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
           "--watch-interval", "0", str(served)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C to stop" in line:
                break
        text = "".join(lines)
        assert f"serving {MODEL}" in text, text
        url = re.search(r"HTTP\s+http://(\S+)", text).group(1)
        control = re.search(r"control (http://\S+)", text).group(1)

        def rollout(*args: str) -> str:
            res = CliRunner().invoke(main, ["rollout", MODEL, *args, "--serve-url", control,
                                            "--admin-key-file", str(key_file)])
            return res.output

        assert "no rollout of roll" in rollout("--status")
        package_signed(replace(recipe, version=2), keys, acceptance_dir=golden)
        add_release(factory, k, k, k)
        push(factory, MODEL, f"oci-layout:{layout}:2")
        with Load(url) as load:
            pull("2")  # beside the live server: the model folder now holds version 2 only
            assert sorted(p.name for p in (served / MODEL).iterdir() if p.is_dir()) == ["2"]
            proc.send_signal(signal.SIGHUP)
            deadline, last = time.monotonic() + 180, ""
            while time.monotonic() < deadline and not re.search(r": (switched|rolled_back|failed)", last):
                time.sleep(1.0)
                last = rollout("--status")
            switched_at = time.monotonic()
            time.sleep(1.5)
        assert "roll 1 -> 2: switched" in last, last
        assert load.failed() == [], load.failed()[:3]
        assert [r for r in load.results if r[0] > switched_at] and all(
            r[3] == "2" for r in load.results if r[0] > switched_at)
        with Load(url) as load:
            undo = rollout("--undo")
            undone_at = time.monotonic()
            time.sleep(1.5)
        assert "undone" in undo, undo
        assert load.failed() == [], load.failed()[:3]
        sent_after_undo = [r for r in load.results if r[0] > undone_at]
        assert sent_after_undo and all(r[3] == "1" for r in sent_after_undo), {r[3] for r in sent_after_undo}
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, text + rest
        assert "watch: rolling out roll version 2 (serving 1)" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
