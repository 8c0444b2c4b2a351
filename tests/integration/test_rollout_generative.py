"""model-factory rollout of a text-generation model on the real Triton, under steady generate traffic: the shadow
mirrors finished greedy requests to the candidate (loaded non-decoupled) and scores token agreement; v1 -> v2 (the same
weights) switches with no failed request (every request sent after the switch answered by v2) and --undo
returns to v1; a v3 of other weights (its own golden continuations, so it passes acceptance) is rolled back by
the gate while v1 keeps serving."""

from __future__ import annotations

import json
import random
import shutil
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.generative_repository import layout_generative_model
from tests.release_policy import released_policy
from tests.request_load import RequestLoad

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("tuf", reason="pip install 'model-factory[sign]' (python-tuf)")

MODEL = "lm"
KEY = "rollout-generative-admin-key-0123"
PARAMS = {"memory_budget_mib": 128, "max_active_sequences": 4, "max_waiting_sequences": 64}


@dataclass
class Env:
    server: object
    control: object
    endpoint: object
    key_file: Path


@pytest.fixture(scope="module")
def env(tiny_llm, tmp_path_factory):
    """Serving v1 of a released tiny Llama; v2 (a copy of v1) and v3 (another Llama, random weights of another
    seed, with its own build's golden continuations) signed and released while it serves."""
    from model_factory.serving.control_api import ControlServer
    from model_factory.serving.rollout import RolloutControl
    from model_factory.serving.server import ServerOptions, start_verified_server
    from model_factory.signing import SignerConfig, generate_keypair, sign_model_version
    from model_factory.signing.release import add_release
    from tests.generative_models import make_causal_lm

    hf, onnx_dir = tiny_llm
    root = tmp_path_factory.mktemp("rollout-gen")
    repo = root / "repo"
    keys = generate_keypair(root / "keys")
    v1 = layout_generative_model(hf, onnx_dir, repo, MODEL, **PARAMS)
    model_dir = v1.parent
    sign_model_version(model_dir, int(v1.name), SignerConfig(keys.private_key))
    policy, k = released_policy(repo, keys, root)
    # v3's weights: the same shape and tokenizer, another seed; built by the factory like v1.
    other_hf = make_causal_lm("llama", root / "other-hf", max_positions=2048, seed=1)
    other = layout_generative_model(other_hf, None, root / "other-repo", MODEL, **PARAMS)

    server, report = start_verified_server(repo, ServerOptions(0, 0, 0, admin_key=KEY), policy,
                                           log_file=root / "tritonserver.log", cost_cache=root / "cost-cache")
    try:
        assert report.served == (MODEL,), report.refused
        control = RolloutControl(server, report.digests, report.served, poll_s=0.1)
        endpoint = ControlServer(control, server.admin_key).start()
        shutil.copytree(v1, model_dir / "2")
        shutil.copytree(other, model_dir / "3")
        for v in (2, 3):
            sign_model_version(model_dir, v, SignerConfig(keys.private_key))
        assert add_release(repo, k, k, k) == 2
        key_file = root / "admin-key"
        key_file.write_text(KEY + "\n")
        yield Env(server, control, endpoint, key_file)
        endpoint.stop()
    finally:
        assert server.stop() == 0


class GenerateLoad(RequestLoad):
    """Clients sending greedy generate requests back to back: (sent, answered, outcome, model_version)."""

    def connect(self, i: int) -> random.Random:
        return random.Random(i)

    def request(self, rng: random.Random, i: int, n: int) -> tuple[str, str | None]:
        prompt = [rng.randrange(3, 2000) for _ in range(rng.randrange(2, 24))]
        body = {"prompt_ids": prompt, "max_tokens": 12, "min_tokens": 12, "temperature": 0.0}
        req = urllib.request.Request(f"http://{self.url}/v2/models/{MODEL}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        if "error" in answer or len(answer.get("output_ids") or []) != 12:
            return f"bad answer {answer}", None
        return "ok", str(answer.get("model_version"))


def _rollout(env: Env, *args: str):
    from click.testing import CliRunner

    from model_factory.cli.main import main

    return CliRunner().invoke(main, ["rollout", MODEL, *args, "--serve-url", env.endpoint.url,
                                     "--admin-key-file", str(env.key_file)])


def test_a_generative_switch_under_load_loses_no_request_and_undo_returns_to_v1(env: Env) -> None:
    with GenerateLoad(env.server.http_url) as load:
        before = len(load.results)
        result = _rollout(env, "2", "--min-requests", "12", "--gate", "0.99")
        switched_at = time.monotonic()
        time.sleep(2.0)
        after_switch = len(load.results)
        undo = _rollout(env, "--undo")
        undone_at = time.monotonic()
        time.sleep(2.0)
    assert result.exit_code == 0, result.output
    status = env.control.status(MODEL)
    assert status.mirrored >= 12 and status.agreement == 1.0 and status.candidate_errors == 0, status
    assert load.failed() == [], load.failed()[:3]
    assert before > 0 and all(r[3] == "1" for r in load.results[:before])
    sent_after = [r for r in load.results[:after_switch] if r[0] > switched_at]
    assert sent_after and all(r[3] == "2" for r in sent_after), {r[3] for r in sent_after}
    assert undo.exit_code == 0, undo.output
    sent_after_undo = [r for r in load.results if r[0] > undone_at]
    assert sent_after_undo and all(r[3] == "1" for r in sent_after_undo), {r[3] for r in sent_after_undo}
    # The switch loaded v2 quietly (nice 19 beside live traffic) and read the prefill cost v1's load had measured
    # for the same graph instead of running the warm-up again.
    loads = [line for line in env.server.log_file.read_text().splitlines()
             if f"model-factory backend: {MODEL} generates" in line]
    assert len(loads) == 2, loads  # v1 at the start, v2 at the switch (the undo loads nothing)
    assert "(measured)" in loads[0] and "load quiet" not in loads[0], loads[0]
    assert "measured at an earlier load" in loads[1] and "load quiet (nice 19)" in loads[1], loads[1]
    print(f"\ngenerative rollout v1->v2: {len(load.results)} requests, 0 failed; {result.output.strip()}\n"
          f"{undo.output.strip()}")


def test_a_generative_candidate_of_other_weights_is_rolled_back_and_v1_keeps_serving(env: Env) -> None:
    with GenerateLoad(env.server.http_url) as load:
        result = _rollout(env, "3", "--min-requests", "8", "--gate", "0.99")
        time.sleep(1.0)
    assert result.exit_code == 1, result.output
    assert "rolled back" in result.output and "below the gate 0.99" in result.output, result.output
    status = env.control.status(MODEL)
    assert status.state == "rolled_back" and status.mirrored >= 8 and status.agreement < 0.5, status
    assert status.worst and all(len(w["input_hash"]) == 16 for w in status.worst)
    assert load.failed() == [], load.failed()[:3]
    assert load.results and all(r[3] == "1" for r in load.results)
    print(f"\ngenerative candidate rolled back: agreement {status.agreement:.4f} over {status.mirrored}")
