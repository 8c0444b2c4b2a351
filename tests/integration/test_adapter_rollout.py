"""A LoRA adapter rolled out v1 -> v2 while its base serves, and undone, on the real server (issue 52, rollouts).

The session's tiny Llama is the base; two adapters are trained here with ``peft`` (tests/lora_adapters.py: unlike
each other, so their greedy tokens differ) and built by the factory as versions 1 and 2 of one adapter entry,
``support``, signed and released. ``serve`` starts with version 1; ``model-factory rollout support 2`` verifies,
accepts and switches it while clients keep calling the adapter and the base: no request fails, every adapter request
sent after the switch answers as ``transformers`` + ``peft`` with version 2 does, and the base answers as itself
throughout; ``--undo`` brings version 1 back the same way. A version 3 whose ``adapter.json`` names other base
bytes (signed and released all the same) is refused by name before anything changes; ``serve --watch`` (a scan) says
that refusal once and, once version 3 is gone, rolls version 2 out by the same path.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.generative_repository import layout_generative_model
from tests.lora_adapters import ADAPTERS, adapter_recipe, peft_greedy, train_adapter
from tests.release_policy import released_policy
from tests.request_load import RequestLoad

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("peft", reason="peft trains the tests' adapters")
pytest.importorskip("tuf", reason="pip install 'model-factory[sign]' (python-tuf)")

BASE, ADAPTER, TOKENS = "tiny_llm", "support", 8
KEY = "adapter-rollout-admin-key-012345"
PROMPTS = [[5 + i, 40 + 3 * i, 300 + 7 * i, 77, 1000 + i] for i in range(3)]


@dataclass
class Env:
    server: object
    frontend: object
    control: object
    endpoint: object
    key_file: Path
    repo: Path
    signer: object
    release_keys: list
    root: Path
    peft: dict  # version -> PEFT folder
    hf: Path  # the base's Hugging Face folder (the adapters' recipes' adapter.base_source)


@pytest.fixture(scope="module")
def env(tiny_llm, tmp_path_factory):
    from model_factory.build.adapter import build_adapter
    from model_factory.recipe import load_recipe
    from model_factory.serving.control_api import ControlServer
    from model_factory.serving.openai_api import OpenAIFrontend, generative_models
    from model_factory.serving.rollout import RolloutControl
    from model_factory.serving.server import ServerOptions, start_verified_server
    from model_factory.signing import SignerConfig, generate_keypair, sign_model_version

    hf, _ = tiny_llm
    root = tmp_path_factory.mktemp("adapter-rollout")
    keys = generate_keypair(root / "keys")
    signer = SignerConfig(private_key=keys.private_key, password=None)
    repo = root / "repo"
    layout_generative_model(hf, None, repo, BASE, memory_budget_mib=256, max_active_sequences=8,
                            max_waiting_sequences=64)
    sign_model_version(repo / BASE, 1, signer)
    peft = {1: train_adapter(hf, root / "peft-v1", **ADAPTERS["support"]),
            2: train_adapter(hf, root / "peft-v2", **ADAPTERS["contracts"])}
    build_adapter(load_recipe(adapter_recipe(root / "recipes-v1", ADAPTER, peft[1], repo / BASE, hf, repo)),
                  signer=signer)
    policy, k = released_policy(repo, keys, root)
    server, report = start_verified_server(repo, ServerOptions(0, 0, 0, admin_key=KEY), policy,
                                           log_file=root / "tritonserver.log", cost_cache=root / "cost-cache")
    try:
        assert report.served == (BASE,), report.refused
        frontend = OpenAIFrontend(server.http_url, generative_models(repo, list(report.served))).start()
        control = RolloutControl(server, report.digests, report.served, poll_s=0.1)
        endpoint = ControlServer(control, server.admin_key).start()
        key_file = root / "admin-key"
        key_file.write_text(KEY + "\n")
        yield Env(server, frontend, control, endpoint, key_file, repo, signer, k, root, peft, hf)
        endpoint.stop()
        frontend.stop()
    finally:
        assert server.stop() == 0, server.log_tail(30)


@pytest.fixture(scope="module")
def expected(env, tiny_llm):
    """model key (None: the base; 1, 2: the adapter's versions) -> per prompt the text transformers (+ peft) gives,
    and the text up to its first near-tie (what any faithful run must start with)."""
    import transformers

    hf, _ = tiny_llm
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    out = {}
    for key, folder in ((None, None), (1, env.peft[1]), (2, env.peft[2])):
        out[key] = []
        for tokens, tie in peft_greedy(hf, folder, PROMPTS, TOKENS):
            end = len(tokens) if tie is None else tie
            out[key].append((tok.decode(tokens, skip_special_tokens=True),
                             tok.decode(tokens[:end], skip_special_tokens=True).rstrip("\ufffd"), tie is None))
    assert [t for t, _, _ in out[1]] != [t for t, _, _ in out[2]]  # the versions answer visibly apart
    return out


def answered_by(expected: dict, i: int, text: str) -> set:
    """Which of the base / adapter versions ``text`` (an answer to PROMPTS[i]) is consistent with."""
    return {key for key, rows in expected.items()
            if (text == rows[i][0]) or (not rows[i][2] and text.startswith(rows[i][1]))}


def complete(url: str, model: str, i: int) -> str:
    body = json.dumps({"model": model, "prompt": PROMPTS[i], "max_tokens": TOKENS, "min_tokens": TOKENS,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


class MixedLoad(RequestLoad):
    """Clients calling the adapter and the base in turn: detail ``(model, prompt index, text)``."""

    def __init__(self, url: str) -> None:
        super().__init__(url, clients=3, join_s=180)

    def request(self, client, i: int, n: int) -> tuple[str, tuple]:
        model = BASE if (i + n) % 3 == 0 else ADAPTER
        k = (i + n) % len(PROMPTS)
        return "ok", (model, k, complete(self.url, model, k))


def rollout(env, *args: str):
    from click.testing import CliRunner

    from model_factory.cli.main import main

    return CliRunner().invoke(main, ["rollout", ADAPTER, *args, "--serve-url", env.endpoint.url,
                                     "--admin-key-file", str(env.key_file)])


def check_answers(load: MixedLoad, expected: dict, after: float, version: int) -> int:
    """Every answer consistent with its model (the adapter's: version 1 or 2); those sent after ``after`` with
    ``version``. Returns how many adapter requests were sent after it."""
    later = 0
    for sent, _, _, (model, i, text) in load.results:
        seen = answered_by(expected, i, text)
        if model == BASE:
            assert None in seen, (i, text)
            continue
        assert seen & {1, 2}, (i, text, expected[1][i], expected[2][i])
        if sent > after:
            later += 1
            assert version in seen, (version, i, text)
    return later


def test_an_adapter_rolls_out_under_load_while_its_base_serves_and_the_undo_brings_v1_back(env, expected) -> None:
    assert 1 in answered_by(expected, 0, complete(env.frontend.url, ADAPTER, 0))  # version 1 serves
    _released_version_2(env)
    pids_before = _stub_pids(env)
    with MixedLoad(env.frontend.url) as load:
        result = rollout(env, "2")
        switched_at = time.monotonic()
        time.sleep(4.0)
    assert result.exit_code == 0, result.output
    status = env.control.status(ADAPTER)
    assert status.state == "switched" and status.judged_by == "acceptance", status
    assert "mirrored 0/" not in result.output and "agreement" not in result.output, result.output
    assert "not mirrored (its acceptance is its gate: passed: its build's gate" in result.output, result.output
    assert load.failed() == [], load.failed()[:3]
    after_switch = check_answers(load, expected, switched_at, 2)
    assert after_switch > 0, "no adapter request was sent after the switch"
    switch_requests = len(load.results)
    # The base's stubs were loaded again; the old ones end once their requests are answered.
    deadline = time.monotonic() + 60
    while not _stub_pids(env).isdisjoint(pids_before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _stub_pids(env) and _stub_pids(env).isdisjoint(pids_before), (pids_before, _stub_pids(env))
    with MixedLoad(env.frontend.url) as load:
        undo = rollout(env, "--undo")
        undone_at = time.monotonic()
        time.sleep(4.0)
    assert undo.exit_code == 0, undo.output
    assert env.control.status(ADAPTER).state == "undone"
    assert load.failed() == [], load.failed()[:3]
    after_undo = check_answers(load, expected, undone_at, 1)
    assert after_undo > 0
    print(f"\nadapter rollout v1->v2: {switch_requests} requests, 0 failed, {after_switch} adapter requests after the "
          f"switch; undo: {len(load.results)} requests, 0 failed, {after_undo} after it. {result.output.strip()}")


def test_an_adapter_version_built_for_other_base_bytes_is_refused_by_name_before_anything_changes(env,
                                                                                               expected) -> None:
    rel = _released_other_base_version(env, 3)
    pids_before = _stub_pids(env)
    result = rollout(env, "3")
    assert result.exit_code == 1, result.output
    assert (f"refused: adapter {ADAPTER} version 3 was built for {BASE} version 1 whose {rel} differs from the "
            f"{BASE} version 1 serving here: it is another base") in " ".join(result.output.split()), result.output
    assert _stub_pids(env) == pids_before  # nothing loaded
    assert env.server.adapter_versions[ADAPTER] == 1
    for i in range(len(PROMPTS)):
        assert 1 in answered_by(expected, i, complete(env.frontend.url, ADAPTER, i))


def test_the_watch_rolls_a_newer_adapter_version_out_and_says_a_refused_one_once(env, expected) -> None:
    """``serve --watch`` / SIGHUP (``RolloutControl.scan``) looks at the served bases' adapter entries as at models:
    the newest version (3, built for other base bytes) is refused and said once; once it is gone, version 2 is rolled
    out by the same path as ``model-factory rollout``, and the adapter answers as version 2."""
    if not (env.repo / ADAPTER / "3").is_dir():
        _released_other_base_version(env, 3)
    _released_version_2(env)
    serving = env.server.adapter_versions[ADAPTER]
    assert serving == 1, serving
    first = env.control.scan()
    assert len(first) == 1 and first[0].startswith(
        f"watch: {ADAPTER} version 3 not rolled out: refused: adapter {ADAPTER} version 3 was built for"), first
    assert env.control.scan() == []  # the same refusal is said once
    shutil.rmtree(env.repo / ADAPTER / "3")
    assert env.control.scan() == [f"watch: rolling out {ADAPTER} version 2 (serving 1)"]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and env.control.status(ADAPTER).state not in ("switched", "rolled_back",
                                                                                    "failed"):
        time.sleep(0.5)
    status = env.control.status(ADAPTER)
    assert status.state == "switched" and status.judged_by == "acceptance", status
    assert env.server.adapter_versions[ADAPTER] == 2
    for i in range(len(PROMPTS)):
        assert 2 in answered_by(expected, i, complete(env.frontend.url, ADAPTER, i))
    assert env.control.scan() == []  # nothing newer; version 2's rollout ended and is not tried again


def _released_version_2(env) -> None:
    """Version 2 of the adapter (the second peft adapter), built, signed and released (once)."""
    from model_factory.build.adapter import build_adapter
    from model_factory.recipe import load_recipe
    from model_factory.signing.release import add_release

    if (env.repo / ADAPTER / "2").is_dir():
        return
    build_adapter(load_recipe(adapter_recipe(env.root / "recipes-v2", ADAPTER, env.peft[2], env.repo / BASE, env.hf,
                                             env.repo, version=2)), signer=env.signer)
    k = env.release_keys
    add_release(env.repo, k, k, k)


def _released_other_base_version(env, version: int) -> str:
    """Version ``version``: version 1's files with ``adapter.json`` naming other bytes for one base file (as if
    trained on another base), signed and released all the same; returns that file's name."""
    from model_factory.signing import sign_model_version
    from model_factory.signing.release import add_release

    folder = env.repo / ADAPTER / str(version)
    shutil.copytree(env.repo / ADAPTER / "1", folder)
    spec = json.loads((folder / "adapter.json").read_text())
    rel = sorted(spec["base_digests"])[0]
    spec["version"], spec["base_digests"][rel] = version, "0" * 64
    (folder / "adapter.json").write_text(json.dumps(spec))
    sign_model_version(env.repo / ADAPTER, version, env.signer)
    k = env.release_keys
    add_release(env.repo, k, k, k)
    return rel


def _stub_pids(env) -> set[int]:
    from model_factory.serving.supervise import stub_pids_by_version

    found = stub_pids_by_version(env.server.process.pid, env.server.served_repository, BASE)
    return {pid for pids in found.values() for pid in pids}
