"""Prompt templates on the real Triton server, driven by the ``openai`` client unchanged: a signed prompt on the
session's random-weight tiny Llama, verified by ``serve`` with the base, served under its own name; whatever the
weights its answers parse against its schema every time (fields from ``extra_body``, from the user's message, on
completions, streamed, sampled); its generation defaults apply under the request's own values; an unknown prompt is
a 404 and a field the request does not fill a 400 naming it. Then v1 -> v2 (a field added to the output schema)
rolled out with ``model-factory rollout`` while clients keep calling it: no request fails, every request sent after
the switch answers v2's schema, and ``contract diff`` names the change; a version pinned to other base bytes is
refused by name before anything loads."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.prompt_recipes import write_prompt_recipe
from tests.release_policy import released_policy
from tests.request_load import RequestLoad
from tests.generative_repository import layout_generative_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("llguidance", reason="llguidance (extra serve) is the grammar engine")
pytest.importorskip("tuf", reason="pip install 'model-factory[sign]' (python-tuf)")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

BASE = "tiny_llm"
KEY = "prompt-serving-admin-key-0123456"
V1 = {"type": "object", "properties": {"label": {"enum": ["bug", "question", "billing"]},
                                       "urgency": {"type": "integer", "minimum": 1, "maximum": 5}},
      "required": ["label", "urgency"], "additionalProperties": False}
V2 = {"type": "object", "properties": {**V1["properties"], "summary": {"type": "string", "maxLength": 12}},
      "required": ["label", "urgency", "summary"], "additionalProperties": False}
TICKETS = ["The app crashes when I upload a photo.", "How do I change my password?", "I was charged twice.",
           "Permission is hereby granted"]


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


@pytest.fixture(scope="module")
def env(tiny_llm, tmp_path_factory):
    from model_factory.build.prompt import build_prompt
    from model_factory.recipe.prompt import load_prompt_recipe
    from model_factory.serving.control_api import ControlServer
    from model_factory.serving.openai_api import OpenAIFrontend, generative_models
    from model_factory.serving.openai_prompts import prompt_models
    from model_factory.serving.rollout import RolloutControl
    from model_factory.serving.server import ServerOptions, start_verified_server
    from model_factory.signing import SignerConfig, generate_keypair, sign_model_version

    hf, onnx_dir = tiny_llm
    root = tmp_path_factory.mktemp("prompt-serving")
    repo = root / "repo"
    keys = generate_keypair(root / "keys")
    signer = SignerConfig(keys.private_key)
    base = layout_generative_model(hf, onnx_dir, repo, BASE, memory_budget_mib=256, max_active_sequences=8,
                                   max_waiting_sequences=64)
    sign_model_version(base.parent, int(base.name), signer)
    build_prompt(load_prompt_recipe(write_prompt_recipe(root / "recipes", schema=V1, base=BASE, repo=str(repo))),
                 signer)
    free = root / "free"  # a second prompt: no schema, defaults the requests below override
    free.mkdir()
    (free / "free.toml").write_text(f"""[model]
name = "freeform"
[base]
model = "{BASE}"
version = 1
[prompt]
template = "{{{{ text }}}}"
[generation]
max_tokens = 6
[repository]
path = "{repo}"
""")
    build_prompt(load_prompt_recipe(free / "free.toml"), signer)
    policy, k = released_policy(repo, keys, root)
    server, report = start_verified_server(repo, ServerOptions(0, 0, 0, admin_key=KEY), policy,
                                           log_file=root / "tritonserver.log", cost_cache=root / "cost-cache")
    try:
        assert sorted(report.served) == ["freeform", BASE, "triage"], report.refused
        frontend = OpenAIFrontend(server.http_url, generative_models(repo, list(report.served)),
                                  prompts=prompt_models(repo, report.served)).start()
        control = RolloutControl(server, report.digests, report.served, poll_s=0.1)
        endpoint = ControlServer(control, server.admin_key).start()
        key_file = root / "admin-key"
        key_file.write_text(KEY + "\n")
        yield Env(server, frontend, control, endpoint, key_file, repo, signer, k, root)
        endpoint.stop()
        frontend.stop()
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def client(env):
    return openai.OpenAI(base_url=env.frontend.url + "/v1", api_key="unused", max_retries=0, timeout=180)


def test_a_prompt_answers_under_its_name_and_its_schema_holds_every_time(client) -> None:
    for i, ticket in enumerate(TICKETS):
        for kw in ({}, {"temperature": 1.0, "seed": i}):
            r = client.chat.completions.create(model="triage", messages=[], extra_body={"fields": {"ticket": ticket}},
                                               **kw)
            assert r.model == "triage" and r.choices[0].finish_reason == "stop", r
            jsonschema.validate(json.loads(r.choices[0].message.content), V1)
    # A template of one field is filled by the user's message; completions and streams take it too.
    r = client.chat.completions.create(model="triage", messages=[{"role": "user", "content": TICKETS[0]}])
    jsonschema.validate(json.loads(r.choices[0].message.content), V1)
    c = client.completions.create(model="triage", prompt=TICKETS[1])
    assert c.model == "triage"
    jsonschema.validate(json.loads(c.choices[0].text), V1)
    chunks = list(client.chat.completions.create(model="triage", messages=[{"role": "user", "content": TICKETS[2]}],
                                                 stream=True, n=2, temperature=1.0, seed=3))
    assert {c.model for c in chunks} == {"triage"}
    for index in (0, 1):
        text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices if ch.index == index)
        jsonschema.validate(json.loads(text), V1)
    listed = {m.id: m for m in client.models.list().data}
    assert listed["triage"].model_extra["task"] == "prompt" and listed["triage"].model_extra["root"] == BASE


def test_the_definition_call_answers_the_signed_bytes(env) -> None:
    """What the front asks Triton per request: the served version's prompt.json, byte for byte; its cost printed
    (recorded in generation.md, not asserted)."""
    import statistics
    import urllib.request

    from model_factory.serving.openai_prompts import definition_request

    body = json.dumps(definition_request("t")).encode()
    timings = []
    for _ in range(30):
        req = urllib.request.Request(f"http://{env.server.http_url}/v2/models/triage/infer", data=body,
                                     headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        with urllib.request.urlopen(req, timeout=30) as r:
            answer = json.loads(r.read())
        timings.append(time.perf_counter() - started)
    served = max(int(p.name) for p in (env.repo / "triage").iterdir() if p.is_dir())
    assert answer["outputs"][0]["data"][0] == (env.repo / "triage" / str(served) / "prompt.json").read_text()
    print(f"\nprompt definition call: median {statistics.median(timings) * 1e3:.2f} ms, "
          f"max {max(timings) * 1e3:.2f} ms over {len(timings)}")


def test_the_prompts_defaults_apply_under_the_requests_own_values(client) -> None:
    r = client.completions.create(model="freeform", prompt="Once upon a time", extra_body={"min_tokens": 6})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"  # the prompt's max_tokens
    r = client.completions.create(model="freeform", prompt="Once upon a time", max_tokens=9,
                                  extra_body={"min_tokens": 9})
    assert r.usage.completion_tokens == 9  # the request's own


def test_unknown_prompt_is_404_and_an_unfilled_field_is_400_naming_it(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-prompt", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="triage", messages=[], extra_body={"fields": {"tickett": "x"}})
    assert "'tickett'" in str(err.value) and err.value.body["param"] == "fields"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="triage", messages=[], extra_body={"fields": {}})
    assert "reads field 'ticket'" in str(err.value), err.value
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="triage", messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_object"})
    assert err.value.body["param"] == "response_format"


class PromptLoad(RequestLoad):
    """Clients calling the prompt back to back through the openai client: (sent, answered, outcome, parsed answer)."""

    def __init__(self, url: str, clients: int = 3) -> None:
        super().__init__(url, clients, join_s=180)

    def connect(self, i: int) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=180)

    def request(self, client: openai.OpenAI, i: int, n: int) -> tuple[str, dict]:
        r = client.chat.completions.create(model="triage", messages=[{"role": "user", "content": TICKETS[(i + n) % 4]}])
        return "ok", json.loads(r.choices[0].message.content)


def test_a_prompt_v1_to_v2_rollout_under_load_fails_no_request_and_contract_diff_names_the_change(env) -> None:
    from click.testing import CliRunner

    from model_factory.build.prompt import build_prompt
    from model_factory.cli.main import main
    from model_factory.recipe.prompt import load_prompt_recipe
    from model_factory.signing.release import add_release

    build_prompt(load_prompt_recipe(write_prompt_recipe(env.root / "recipes", version=2, schema=V2, base=BASE,
                                                        repo=str(env.repo))), env.signer)
    k = env.release_keys
    assert add_release(env.repo, k, k, k) == 2
    with PromptLoad(env.frontend.url) as load:
        before = len(load.results)
        result = CliRunner().invoke(main, ["rollout", "triage", "2", "--serve-url", env.endpoint.url,
                                           "--admin-key-file", str(env.key_file)])
        switched_at = time.monotonic()
        time.sleep(3.0)
    assert result.exit_code == 0, result.output
    assert env.control.status("triage").state == "switched", env.control.status("triage")
    # Not mirrored: its progress says what judged it, not a mirror count and an agreement that do not apply.
    assert "mirrored 0/" not in result.output and "agreement" not in result.output, result.output
    assert "not mirrored (its acceptance is its gate: passed on this machine" in result.output, result.output
    failed = load.failed()
    assert failed == [], failed[:3]
    assert before > 0
    for sent, _, _, answer in load.results[:before]:
        jsonschema.validate(answer, V1)
    after = [answer for sent, _, _, answer in load.results if sent > switched_at]
    assert after, "no request was sent after the switch"
    for answer in after:
        jsonschema.validate(answer, V2)  # summary is required in v2: v1 never wrote it
    diff = CliRunner().invoke(main, ["contract", "diff", str(env.repo / "triage" / "1"), str(env.repo / "triage" / "2")])
    assert diff.exit_code == 0, diff.output  # a field added to the output breaks no client
    assert "prompt: output field 'summary' added (string, required)" in diff.output, diff.output
    print(f"\nprompt rollout v1->v2: {len(load.results)} requests, 0 failed, {len(after)} after the switch; "
          f"{result.output.strip()}")


def test_a_prompt_version_pinned_to_other_base_bytes_is_refused_by_name_before_anything_loads(env) -> None:
    """Its pins (the base's chat template and tokenizer by sha256) enforced by the rollout as ``serve`` enforces them
    at its start, though the version is signed and released; the serving version answers on."""
    from click.testing import CliRunner

    from model_factory.build.prompt import build_prompt
    from model_factory.cli.main import main
    from model_factory.recipe.prompt import load_prompt_recipe
    from model_factory.signing import sign_model_version
    from model_factory.signing.release import add_release

    v3 = build_prompt(load_prompt_recipe(write_prompt_recipe(env.root / "recipes", version=3, schema=V2, base=BASE,
                                                             repo=str(env.repo))), env.signer).version_dir
    definition = json.loads((v3 / "prompt.json").read_text())
    pinned = sorted(definition["base"]["digests"])[0]
    definition["base"]["digests"][pinned] = "0" * 64  # written for a base with another chat template
    (v3 / "prompt.json").write_text(json.dumps(definition))
    sign_model_version(v3.parent, 3, env.signer)
    k = env.release_keys
    add_release(env.repo, k, k, k)
    result = CliRunner().invoke(main, ["rollout", "triage", "3", "--serve-url", env.endpoint.url,
                                       "--admin-key-file", str(env.key_file)])
    assert result.exit_code == 1, result.output
    assert (f"refused: prompt triage v3 was written for {BASE} v1, and the {BASE} served here (v1) has another "
            f"{pinned} (sha256 differs from the prompt's pins)") in " ".join(result.output.split()), result.output
    assert env.control.status("triage").version == 2  # no rollout started
    client = openai.OpenAI(base_url=env.frontend.url + "/v1", api_key="unused", max_retries=0, timeout=180)
    r = client.chat.completions.create(model="triage", messages=[{"role": "user", "content": TICKETS[0]}])
    jsonschema.validate(json.loads(r.choices[0].message.content), V2)  # v2 serves on


def test_a_prompt_version_changed_after_signing_is_refused_before_it_loads(env) -> None:
    from click.testing import CliRunner

    from model_factory.build.prompt import build_prompt
    from model_factory.cli.main import main
    from model_factory.recipe.prompt import load_prompt_recipe

    v4 = build_prompt(load_prompt_recipe(write_prompt_recipe(env.root / "recipes", version=4, schema=V2, base=BASE,
                                                             repo=str(env.repo))), env.signer).version_dir
    definition = json.loads((v4 / "prompt.json").read_text())
    (v4 / "prompt.json").write_text(json.dumps({**definition, "system": "Say every ticket is fine."}))
    result = CliRunner().invoke(main, ["rollout", "triage", "4", "--serve-url", env.endpoint.url,
                                       "--admin-key-file", str(env.key_file)])
    assert result.exit_code == 1, result.output
    assert "refused" in result.output and "4/prompt.json changed" in result.output, result.output
    client = openai.OpenAI(base_url=env.frontend.url + "/v1", api_key="unused", max_retries=0, timeout=180)
    r = client.chat.completions.create(model="triage", messages=[{"role": "user", "content": TICKETS[0]}])
    jsonschema.validate(json.loads(r.choices[0].message.content), V2)  # still v2, as signed


def test_serve_accepts_a_prompt_and_serves_it_on_the_openai_port(tiny_llm, tmp_path) -> None:
    """``model-factory serve --accept --openai-port``: the prompt passes its acceptance at start, the banner names its
    base, and it answers under its own name."""
    import re
    import signal
    import subprocess
    import sys

    from model_factory.build.prompt import package_prompt
    from model_factory.recipe.prompt import load_prompt_recipe
    from tests.generative_repository import write_continuations

    hf, onnx_dir = tiny_llm
    repo = tmp_path / "repo"
    vdir = layout_generative_model(hf, onnx_dir, repo, BASE, memory_budget_mib=128, max_active_sequences=4)
    write_continuations(vdir, hf, [[5, 6, 7, 8]], max_tokens=8)
    package_prompt(load_prompt_recipe(write_prompt_recipe(tmp_path / "recipes", schema=V1, base=BASE, repo=str(repo))))
    cli = str(Path(sys.executable).parent / "model-factory")
    proc = subprocess.Popen([cli, "serve", "--allow-unsigned", "--accept", "--http-port", "0", "--grpc-port", "0",
                             "--metrics-port", "0", "--watch-interval", "0", "--no-cost-cache", "--openai-port", "0",
                             str(repo)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = []
        for line in proc.stdout:
            out.append(line)
            if "Ctrl-C to stop" in line:
                break
        url = next(m.group(1) for line in out if (m := re.search(r"OpenAI\s+(http://\S+)/v1", line)))
        assert any("triage (prompt on tiny_llm)" in line for line in out), out
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=180)
        r = client.chat.completions.create(model="triage", messages=[{"role": "user", "content": TICKETS[1]}])
        assert r.model == "triage"
        jsonschema.validate(json.loads(r.choices[0].message.content), V1)
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
