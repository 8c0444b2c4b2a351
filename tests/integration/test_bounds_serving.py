"""No bad value reaches an engine, and what builds, verifies and accepts also serves.

Three models made here (random weights, no downloads), built, signed, verified, accepted and served by
one real Triton (``start_verified_server`` against a trust policy, as ``serve`` runs it):

* ``roberta``: RoBERTa-style, ``type_vocab_size = 1`` and a byte-level BPE tokenizer trained in the test.
  It gets no ``token_type_ids`` input, loads, and answers text and ids over HTTP and gRPC as torch does.
* ``encoder``: BERT-style (two token types, vocabulary 30522).
* ``lookup``: a generic ONNX model whose two INT64 inputs index an embedding table (50 rows) and a position
  table (16 rows): bounds the graph implies.

Property-based requests (hypothesis) mix values outside those bounds (ids, token types, masks, positions,
generic indices, negative ones included) with good requests in the same windows: every bad one is
answered 400 for itself alone, naming input, position and range; every good one equals the reference
(torch, or numpy for the lookup model); no 500.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import sys
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = [pytest.mark.integration, pytest.mark.slow]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zoo_models  # noqa: E402

TEXTS = ["John lives in Paris.", "The quarterly report shows revenue grew by twelve percent.",
         "Please restart the router and wait two minutes before trying to connect again, then call us."]
FIXED_COST = {"cost_model": "0.0005,2e-7,1e-9"}
VOCAB, ROWS, POSITIONS, MAX_LEN = 30522, 50, 16, 64
ENCODER_RECIPE = '''[model]
name = "encoder"
task = "embedding"

[source]
kind = "huggingface"
path = "encoder-model"

[quantization]
heldout_data = "heldout.txt"
''' + zoo_models.RECIPE_TAIL + "instance_count = 1\n"
LOOKUP_RECIPE = '''[model]
name = "lookup"
task = "generic"

[source]
kind = "onnx"
path = "lookup.onnx"

[shapes]
max_batch = 8
max_sequence_length = 16
sequence_buckets = [16]

[quantization]
heldout_data = "lookup_heldout.npz"

[repository]
path = "model_repository"
instance_count = 1
'''


@pytest.fixture(scope="module")
def served(tmp_path_factory, minilm_recipe):
    """build -> sign -> verify -> accept -> serve, for the three models, with one server for the module."""
    from model_factory.build.pipeline import build
    from model_factory.demo import write_key_policy
    from model_factory.recipe import load_recipe
    from model_factory.serving.acceptance import accept_repository
    from model_factory.serving.server import ServerOptions, start_verified_server
    from model_factory.signing import SignerConfig, generate_keypair, load_policy, verify_repository

    root = tmp_path_factory.mktemp("bounds")
    keys = generate_keypair(root / "keys")
    policy = write_key_policy(root / "policy.toml", [keys.public_key])
    signer = SignerConfig(private_key=keys.private_key, password=None)
    roberta = zoo_models.make_roberta(root)
    encoder = zoo_models.make_encoder(root, minilm_recipe.source.path)
    (root / "encoder.toml").write_text(ENCODER_RECIPE)
    zoo_models.make_lookup_onnx(root / "lookup.onnx", ROWS, POSITIONS)
    rng = np.random.default_rng(2)
    np.savez(root / "lookup_heldout.npz", ids=rng.integers(0, ROWS, (12, 10)),
             pos=np.tile(np.arange(10), (12, 1)))
    (root / "lookup.toml").write_text(LOOKUP_RECIPE)
    results = {}
    for name in ("roberta", "encoder", "lookup"):
        results[name] = build(load_recipe(root / f"{name}.toml"), signer=signer, parameters=FIXED_COST)
    repo = root / "model_repository"
    verified = verify_repository(repo, load_policy(policy))
    accepted = accept_repository(repo)
    server, report = start_verified_server(repo, ServerOptions(0, 0, 0), policy)
    yield {"server": server, "report": report, "repo": repo, "verified": verified, "accepted": accepted,
           "results": results, "roberta": roberta, "encoder": encoder, "lookup": root / "lookup.onnx"}
    assert server.stop() == 0


def test_every_model_verifies_accepts_and_serves(served) -> None:
    assert [(r.model, r.ok) for r in served["verified"]] == [("encoder", True), ("lookup", True), ("roberta", True)]
    assert [(r.model, r.passed) for r in served["accepted"]] == [("encoder", True), ("lookup", True),
                                                                  ("roberta", True)], served["accepted"]
    assert set(served["report"].served) == {"encoder", "lookup", "roberta"} and not served["report"].refused


def test_roberta_has_no_token_type_input_and_its_bounds_travel_in_the_config(served) -> None:
    from model_factory.backend.requests.input_bounds import parse_bounds
    from model_factory.build.repository import config_parameters, read_config

    config = read_config(served["repo"] / "roberta")
    assert [i.name for i in config.input] == ["input_ids", "attention_mask", "text"]
    bounds = parse_bounds(config_parameters(config)["input_bounds"])
    vocab = json.loads((served["roberta"].folder / "config.json").read_text())["vocab_size"]
    assert bounds == {"input_ids": (0, vocab - 1), "attention_mask": (0, 1)}
    lookup = parse_bounds(config_parameters(read_config(served["repo"] / "lookup"))["input_bounds"])
    assert lookup == {"ids": (0, ROWS - 1), "pos": (0, POSITIONS - 1)}
    encoder = parse_bounds(config_parameters(read_config(served["repo"] / "encoder"))["input_bounds"])
    assert encoder == {"input_ids": (0, VOCAB - 1), "attention_mask": (0, 1), "token_type_ids": (0, 1)}


_TORCH: dict = {}


def _torch_model(member):
    if member.name not in _TORCH:
        import transformers

        folder = str(member.folder)
        _TORCH[member.name] = (transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True),
                               transformers.AutoModel.from_pretrained(folder, local_files_only=True).eval())
    return _TORCH[member.name]


def torch_embedding(member, ids: np.ndarray, mask: np.ndarray, types: np.ndarray | None = None) -> np.ndarray:
    """The recipe's embedding (mean over the mask, normalized) from the transformers model."""
    import torch

    _, model = _torch_model(member)
    kwargs = {"input_ids": torch.as_tensor(ids), "attention_mask": torch.as_tensor(mask)}
    if types is not None:
        kwargs["token_type_ids"] = torch.as_tensor(types)
    with torch.no_grad():
        hidden = model(**kwargs).last_hidden_state
    m = kwargs["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=1).numpy()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_roberta_text_and_ids_match_torch(served, protocol) -> None:
    import tritonclient.grpc as tg
    import tritonclient.http as th

    module = th if protocol == "http" else tg
    server = served["server"]
    client = module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
    member = served["roberta"]
    tok, _ = _torch_model(member)
    try:
        for text in TEXTS:
            enc = tok(text, truncation=True, max_length=MAX_LEN, return_tensors="np")
            want = torch_embedding(member, enc["input_ids"], enc["attention_mask"])[0]
            t = module.InferInput("text", [1, 1], "BYTES")
            t.set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
            got = client.infer("roberta", [t]).as_numpy("embedding")[0]
            np.testing.assert_allclose(got, want, atol=1e-4)
            inputs = []
            for key in ("input_ids", "attention_mask"):
                t = module.InferInput(key, list(enc[key].shape), "INT64")
                t.set_data_from_numpy(enc[key].astype(np.int64))
                inputs.append(t)
            np.testing.assert_allclose(client.infer("roberta", inputs).as_numpy("embedding")[0], want, atol=1e-4)
    finally:
        client.close()


# --------------------------------------------------------------------------- property-based, on the server


def raw_infer(server, model: str, tensors: dict[str, np.ndarray], output: str) -> tuple[int, dict]:
    """POST an inference with binary INT64 tensors built by hand (no client-side checks)."""
    host, port = server.http_url.rsplit(":", 1)
    header = {"inputs": [{"name": n, "datatype": "INT64", "shape": list(a.shape),
                          "parameters": {"binary_data_size": a.nbytes}} for n, a in tensors.items()],
              "outputs": [{"name": output, "parameters": {"binary_data": False}}]}
    head = json.dumps(header).encode()
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", f"/v2/models/{urllib.parse.quote(model)}/infer",
                     body=head + b"".join(a.astype("<i8").tobytes() for a in tensors.values()),
                     headers={"Inference-Header-Content-Length": str(len(head)),
                              "Content-Type": "application/octet-stream"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def _output(body: dict, name: str) -> np.ndarray:
    (o,) = [o for o in body["outputs"] if o["name"] == name]
    return np.asarray(o["data"], dtype=np.float32).reshape(o["shape"])


def _outside(low: int, high: int, reach: int):
    """Values outside [low, high]: just past either end, far past, and negative ones (which would wrap)."""
    return st.one_of(st.integers(high + 1, high + reach), st.integers(-reach, low - 1),
                     st.sampled_from([high + 1, -1, 2**62, -2**62]))


# (input, bad value, position) on the encoder: ids, token types and masks.
encoder_bad = st.tuples(st.sampled_from([("input_ids", 0, VOCAB - 1), ("token_type_ids", 0, 1),
                                         ("attention_mask", 0, 1)]), st.integers(1, 20), st.data())
encoder_good = st.lists(st.integers(5, VOCAB - 1), min_size=1, max_size=20).flatmap(
    lambda ids: st.tuples(st.just(ids), st.lists(st.integers(0, 1), min_size=len(ids), max_size=len(ids))))


def _encoder_tensors(ids, types, mask=None) -> dict[str, np.ndarray]:
    ids = np.asarray([ids], np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids) if mask is None else np.asarray([mask], np.int64),
            "token_type_ids": np.asarray([types], np.int64)}


def _check(server, jobs, answers) -> None:
    for (kind, model, tensors, expect), (status, body) in zip(jobs, answers):
        assert status in (200, 400), (model, status, body)  # never a 500
        if kind == "bad":
            name, position, low, high = expect
            assert status == 400, (model, {k: v.tolist() for k, v in tensors.items()}, body)
            assert f"input '{name}' holds" in body["error"] and f"at position [0, {position}]" in body["error"]
            assert f"{low}..{high}" in body["error"], body["error"]
        else:
            assert status == 200, (model, body)
            np.testing.assert_allclose(_output(body, expect[0]), expect[1], atol=1e-4)


EXAMPLES = settings(max_examples=12, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


@EXAMPLES
@given(bad=st.lists(encoder_bad, min_size=1, max_size=3), good=st.lists(encoder_good, min_size=1, max_size=3))
def test_encoder_values_outside_bounds_are_refused_alone(served, bad, good) -> None:
    member, server = served["encoder"], served["server"]
    jobs = []
    for (name, low, high), length, data in bad:
        position = data.draw(st.integers(0, length - 1))
        tensors = _encoder_tensors([1000 + i for i in range(length)], [0] * length)
        tensors[name][0, position] = data.draw(_outside(low, high, 1000))
        jobs.append(("bad", "encoder", tensors, (name, position, low, high)))
    for ids, types in good:
        tensors = _encoder_tensors(ids, types)
        want = torch_embedding(member, tensors["input_ids"], tensors["attention_mask"], tensors["token_type_ids"])
        jobs.append(("good", "encoder", tensors, ("embedding", want)))
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda j: raw_infer(server, j[1], j[2], "embedding"), jobs))
    _check(server, jobs, answers)


lookup_good = st.integers(1, POSITIONS).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, ROWS - 1), min_size=n, max_size=n), st.lists(st.integers(0, POSITIONS - 1),
                                                                            min_size=n, max_size=n)))
lookup_bad = st.tuples(st.sampled_from([("ids", ROWS - 1), ("pos", POSITIONS - 1)]), lookup_good, st.data())


@EXAMPLES
@given(bad=st.lists(lookup_bad, min_size=1, max_size=3), good=st.lists(lookup_good, min_size=1, max_size=3))
def test_generic_indices_and_positions_outside_the_tables_are_refused_alone(served, bad, good) -> None:
    server = served["server"]
    jobs = []
    for (name, high), (ids, pos), data in bad:
        tensors = {"ids": np.asarray([ids], np.int64), "pos": np.asarray([pos], np.int64)}
        position = data.draw(st.integers(0, len(ids) - 1))
        tensors[name][0, position] = data.draw(_outside(0, high, 100))
        jobs.append(("bad", "lookup", tensors, (name, position, 0, high)))
    for ids, pos in good:
        want = zoo_models.lookup_reference(served["lookup"], [ids], [pos])
        jobs.append(("good", "lookup", {"ids": np.asarray([ids], np.int64), "pos": np.asarray([pos], np.int64)},
                     ("y", want)))
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda j: raw_infer(server, j[1], j[2], "y"), jobs))
    _check(server, jobs, answers)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_token_type_past_the_table_is_invalid_argument_on_both_protocols(served, protocol) -> None:
    """The issue's cases: [0, 5, 0] (was a 500) and [0, -1, 0] (was a 200 with a wrong answer)."""
    import tritonclient.grpc as tg
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    module = th if protocol == "http" else tg
    server = served["server"]
    client = module.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
    try:
        for types, value in (([0, 5, 0], 5), ([0, -1, 0], -1)):
            inputs = []
            for key, arr in _encoder_tensors([1010, 1011, 1012], types).items():
                t = module.InferInput(key, list(arr.shape), "INT64")
                t.set_data_from_numpy(arr)
                inputs.append(t)
            with pytest.raises(InferenceServerException) as info:
                client.infer("encoder", inputs)
            status = str(info.value.status())
            assert ("400" in status) if protocol == "http" else ("INVALID_ARGUMENT" in status)
            assert f"input 'token_type_ids' holds {value} at position [0, 1]; allowed values are 0..1" in \
                info.value.message()
    finally:
        client.close()
