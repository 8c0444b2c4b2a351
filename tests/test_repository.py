"""config.pbtxt through Triton's protobuf, and the atomic, version-preserving repository layout."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from model_factory.errors import FactoryError
from model_factory.backend.contract import SHED_AGE_BOUND_FACTOR
from model_factory.fileio import atomic_dir
from model_factory.build.repository import (FALLBACK_QUEUE_BATCHES, config_dict, config_parameters, config_to_pbtxt,
                                            package_model, parse_config, read_config)


def test_config_round_trips_through_protobuf(minilm_recipe) -> None:
    text = config_to_pbtxt(config_dict(minilm_recipe, {"grouping": "cost_model"}))
    cfg = parse_config(text)
    assert cfg.name == "minilm" and cfg.backend == "python"
    assert cfg.max_batch_size == minilm_recipe.shapes.max_batch
    by_name = {i.name: i for i in cfg.input}
    assert by_name["input_ids"].allow_ragged_batch and by_name["input_ids"].optional
    assert list(by_name["input_ids"].dims) == [-1]
    from tritonclient.grpc import model_config_pb2

    assert by_name["text"].data_type == model_config_pb2.TYPE_STRING
    assert not by_name["text"].allow_ragged_batch  # fixed dims: nothing to be ragged about
    # The backend's own output beside the model's: per row, the tokens a truncated text lost (docs/inputs.md).
    assert [o.name for o in cfg.output] == ["last_hidden_state", "embedding", "truncated_tokens"]
    assert list(cfg.dynamic_batching.preferred_batch_size) == list(minilm_recipe.batching.preferred_batch_sizes)
    assert config_parameters(cfg) == {"grouping": "cost_model"}
    # Rendering the parsed message again gives the same text: nothing lost in the round trip.
    from google.protobuf import text_format

    assert text_format.MessageToString(cfg) == text


def test_queue_is_bounded_by_default_with_two_instances_and_unbounded_with_one(minilm_recipe) -> None:
    assert minilm_recipe.batching.max_queue_size is None  # "auto", the default
    assert minilm_recipe.repository.instance_count == 2
    cfg = parse_config(config_to_pbtxt(config_dict(minilm_recipe, {})))
    # The signed bound: a few full batches (serve derives the deployment's own where it runs), 8x that by default,
    # where requests are shed by their wait (shed_by = "age": serve derives Triton's queue timeout too).
    policy = cfg.dynamic_batching.default_queue_policy
    fallback = FALLBACK_QUEUE_BATCHES * minilm_recipe.shapes.max_batch
    assert minilm_recipe.batching.shed_by == "age"
    assert (policy.max_queue_size, policy.default_timeout_microseconds) == (SHED_AGE_BOUND_FACTOR * fallback, 0)
    by_count = replace(minilm_recipe, batching=replace(minilm_recipe.batching, shed_by="count"))
    policy = parse_config(config_to_pbtxt(config_dict(by_count, {}))).dynamic_batching.default_queue_policy
    assert (policy.max_queue_size, policy.default_timeout_microseconds) == (fallback, 0)
    # One instance: Triton's batcher would lose wake-ups with a bound, so "auto" leaves the queue unbounded.
    one = replace(minilm_recipe, repository=replace(minilm_recipe.repository, instance_count=1))
    cfg = parse_config(config_to_pbtxt(config_dict(one, {})))
    assert cfg.dynamic_batching.default_queue_policy.max_queue_size == 0
    # A number the recipe gives is written as it is, on any instance count.
    seven = replace(one, batching=replace(one.batching, max_queue_size=7))
    assert parse_config(config_to_pbtxt(config_dict(seven, {}))) \
        .dynamic_batching.default_queue_policy.max_queue_size == 7


def test_queue_policy_fields(minilm_recipe) -> None:
    from tritonclient.grpc import model_config_pb2

    cfg = parse_config(config_to_pbtxt(config_dict(minilm_recipe, {})))
    policy = cfg.dynamic_batching.default_queue_policy
    assert policy.timeout_action == model_config_pb2.ModelQueuePolicy.REJECT
    assert cfg.dynamic_batching.priority_levels == 0
    declared = replace(minilm_recipe, batching=replace(minilm_recipe.batching, max_queue_size=7,
                                                       queue_timeout_us=50_000, timeout_action="delay",
                                                       priority_levels=3, default_priority=2))
    cfg = parse_config(config_to_pbtxt(config_dict(declared, {})))
    policy = cfg.dynamic_batching.default_queue_policy
    assert (policy.max_queue_size, policy.default_timeout_microseconds) == (7, 50_000)
    assert policy.timeout_action == model_config_pb2.ModelQueuePolicy.DELAY
    assert (cfg.dynamic_batching.priority_levels, cfg.dynamic_batching.default_priority_level) == (3, 2)


def test_the_signed_config_is_the_same_whatever_the_build_machine(minilm_recipe, tmp_path: Path) -> None:
    """ "auto" carries the budget, not a bound timed on the build machine: two packagings give the same bytes."""
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"not read")
    texts = []
    for i in range(2):
        recipe = replace(minilm_recipe, repository=replace(minilm_recipe.repository, path=tmp_path / f"repo{i}"),
                         batching=replace(minilm_recipe.batching, max_queue_size=None))
        res = package_model(recipe, {"model.onnx": onnx})
        texts.append(res.config_path.read_text())
    assert texts[0] == texts[1]
    params = config_parameters(parse_config(texts[0]))
    assert params["queue_bound"] == "auto" and params["queue_budget_ms"] == str(minilm_recipe.batching.queue_budget_ms)
    assert "task" not in params and "pooling" not in params and "normalize" not in params  # nobody reads them


def test_unknown_or_malformed_parameters_are_refused_at_packaging(minilm_recipe, tmp_path: Path) -> None:
    recipe = replace(minilm_recipe, repository=replace(minilm_recipe.repository, path=tmp_path / "repo"))
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"not read")
    with pytest.raises(FactoryError, match="pooling_mode are not model parameters"):
        package_model(recipe, {"model.onnx": onnx}, parameters={"pooling_mode": "mean"})
    with pytest.raises(FactoryError, match="cost_model must be 'a,b,c'"):
        package_model(recipe, {"model.onnx": onnx}, parameters={"cost_model": "1,2"})


def test_invalid_config_is_refused() -> None:
    with pytest.raises(FactoryError, match="invalid Triton model config"):
        config_to_pbtxt({"name": "m", "max_batch_size": "many"})
    with pytest.raises(FactoryError, match="does not parse"):
        parse_config('name: "m"\nmax_batch_sise: 4\n')


def test_atomic_dir_keeps_old_content_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "half.txt").write_text("half-written")
            raise RuntimeError("interrupted")
    assert (target / "keep.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left behind
    with atomic_dir(target) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert target.stat().st_mode & 0o755 == 0o755  # an ordinary folder, not mkdtemp's 0700


def _fake_artifacts(tmp_path: Path) -> dict[str, Path]:
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"onnx bytes")
    return {"model.onnx": onnx}


def test_package_layout_metadata_and_digests(minilm_recipe, tmp_path: Path) -> None:
    recipe = replace(minilm_recipe, repository=replace(minilm_recipe.repository, path=tmp_path / "repo"))
    res = package_model(recipe, _fake_artifacts(tmp_path), build_info={"note": "test"})
    v = res.version_dir
    assert (v / "model.py").is_file() and (v / "mf_backend" / "model.py").is_file()
    assert not list(v.rglob("__pycache__"))
    meta = json.loads((v / "metadata.json").read_text())
    assert meta["model"] == "minilm" and meta["build"] == {"note": "test"}
    assert "model-factory" in meta["tools"] and "python" in meta["tools"]
    import hashlib

    assert meta["files"]["model.onnx"] == hashlib.sha256(b"onnx bytes").hexdigest()
    assert meta["files"]["mf_backend/batching/executor.py"]
    assert read_config(res.model_dir).name == "minilm"
    # GPU instances fall back to the CPU only when the recipe says so (the example does); no acceptance data given.
    assert recipe.repository.allow_cpu_fallback is True
    assert read_config(res.model_dir).parameters["cpu_fallback"].string_value == "true"
    assert meta["acceptance"] is None


def test_package_keeps_other_versions_and_previous_repo_on_failure(minilm_recipe, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    v1 = replace(minilm_recipe, repository=replace(minilm_recipe.repository, path=repo))
    package_model(v1, _fake_artifacts(tmp_path))
    v2 = replace(v1, version=2)
    package_model(v2, _fake_artifacts(tmp_path))
    assert (repo / "minilm" / "1" / "model.onnx").is_file() and (repo / "minilm" / "2" / "model.onnx").is_file()
    before = (repo / "minilm" / "config.pbtxt").read_text()
    with pytest.raises(FactoryError, match="missing"):
        package_model(replace(v1, version=3), {"model.onnx": tmp_path / "model.onnx",
                                               "model.int8.onnx": tmp_path / "absent.onnx"})
    assert (repo / "minilm" / "config.pbtxt").read_text() == before
    assert not (repo / "minilm" / "3").exists()
    # Nothing half-written: the model and the (hidden, kernel-released) lock file of its writers only.
    assert sorted(p.name for p in repo.iterdir()) == [".minilm.lock", "minilm"]


def _backend_settings(model_dir: Path):
    """The settings the backend would parse from this config.pbtxt (Triton hands initialize() its JSON form)."""
    from google.protobuf import json_format

    from model_factory.backend.settings import parse_settings

    as_json = json_format.MessageToDict(read_config(model_dir), preserving_proto_field_name=True)
    return parse_settings(json.dumps(as_json))


def test_hf_source_writes_vocab_size_and_torchscript_is_packaged(minilm_recipe, tmp_path: Path) -> None:
    recipe = replace(minilm_recipe, repository=replace(minilm_recipe.repository, path=tmp_path / "repo"))
    artifacts = _fake_artifacts(tmp_path)
    ts = tmp_path / "model.torchscript.pt"
    ts.write_bytes(b"torchscript bytes")
    res = package_model(recipe, {**artifacts, "model.torchscript.pt": ts})
    want = json.loads((minilm_recipe.source.path / "config.json").read_text())["vocab_size"]
    assert config_parameters(read_config(res.model_dir))["vocab_size"] == str(want) == "30522"
    settings = _backend_settings(res.model_dir)
    assert settings.vocab_size == 30522 and settings.engine == "auto"
    assert settings.torchscript_file == "model.torchscript.pt"
    assert (res.version_dir / "model.torchscript.pt").read_bytes() == b"torchscript bytes"
    meta = json.loads((res.version_dir / "metadata.json").read_text())
    assert meta["engines"] == ["model.torchscript.pt"]
    import hashlib

    assert meta["files"]["model.torchscript.pt"] == hashlib.sha256(b"torchscript bytes").hexdigest()
    # An explicit parameter wins over the one read from config.json.
    res = package_model(recipe, artifacts, parameters={"vocab_size": "100", "engine": "torch"})
    settings = _backend_settings(res.model_dir)
    assert settings.vocab_size == 100 and settings.engine == "torch"
    assert json.loads((res.version_dir / "metadata.json").read_text())["engines"] == []
    # The recipe's memory budget per launch and [repository] engine are what the backend reads.
    budget = replace(recipe, batching=replace(recipe.batching, max_group_tokens=2048))
    assert _backend_settings(package_model(budget, artifacts).model_dir).max_group_tokens == 2048
    assert settings.max_group_tokens is None  # 0 in the recipe: no budget
    onnx_only = replace(recipe, repository=replace(recipe.repository, engine="onnxruntime"))
    assert _backend_settings(package_model(onnx_only, artifacts).model_dir).engine == "onnxruntime"


def test_non_hf_sources_write_no_vocab_size(tmp_path: Path) -> None:
    from model_factory.recipe import parse_recipe

    recipe = parse_recipe({"model": {"name": "g", "task": "generic"},
                           "source": {"kind": "torch", "factory": "pkg.mod:make"},
                           "inputs": [{"name": "x", "dtype": "FP32", "dims": [-1]}],
                           "outputs": [{"name": "y", "dtype": "FP32", "dims": [-1]}]}, tmp_path)
    res = package_model(recipe, _fake_artifacts(tmp_path))
    assert "vocab_size" not in config_parameters(read_config(res.model_dir))
    assert _backend_settings(res.model_dir).vocab_size is None


def test_classifier_labels_become_the_outputs_label_file(tmp_path: Path) -> None:
    """id2label → <model>/labels.txt, named by the class outputs' label_filename (through the protobuf)."""
    from model_factory.recipe import parse_recipe

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["BertForSequenceClassification"], "hidden_size": 8, "type_vocab_size": 2,
        "vocab_size": 100, "id2label": {"1": "positive", "0": "negative", "2": "neutral"}}))
    data = {"model": {"name": "cls", "task": "classification"}, "source": {"kind": "huggingface", "path": "hf"},
            "classification": {"probabilities": True}, "repository": {"path": "repo"}}
    recipe = parse_recipe(data, tmp_path)
    res = package_model(recipe, _fake_artifacts(tmp_path))
    assert (res.model_dir / "labels.txt").read_text() == "negative\npositive\nneutral\n"
    config = read_config(res.model_dir)
    assert {o.name: o.label_filename for o in config.output} == {"logits": "labels.txt",
                                                                 "probabilities": "labels.txt",
                                                                 "truncated_tokens": ""}  # the backend's
    meta = json.loads((res.version_dir / "metadata.json").read_text())
    assert meta["labels"] == ["negative", "positive", "neutral"] and "../labels.txt" in meta["files"]
    # Rebuilt as an embedding model, the label file goes (no stale labels beside a config without them).
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": 8}))
    res = package_model(parse_recipe(data | {"model": {"name": "cls", "task": "embedding"},
                                            "classification": {}}, tmp_path), _fake_artifacts(tmp_path))
    assert not (res.model_dir / "labels.txt").exists()
    assert all(not o.label_filename for o in read_config(res.model_dir).output)


def _all_precisions(tmp_path: Path) -> dict[str, Path]:
    """Artifacts of every precision as stages leave them; the FP32 and INT8 weights in data files."""
    build = tmp_path / "build"
    build.mkdir()
    artifacts = {}
    for name in ("model.onnx", "model.fp16.onnx", "model.int8.onnx", "model.fp32.plan", "model.int8.plan",
                 "model.fp32.plan.json", "model.int8.plan.json"):
        (build / name).write_bytes(name.encode())
        artifacts[name] = build / name
    for name in ("model.onnx.data", "model.int8.onnx.data"):
        with (build / name).open("wb") as f:
            f.truncate(17 << 20)  # over LINK_MIN_BYTES, sparse: costs no disk
    return artifacts


def _recipe(minilm_recipe, tmp_path: Path, **repository):
    return replace(minilm_recipe, precisions=("fp32", "fp16", "int8"),
                   repository=replace(minilm_recipe.repository, path=tmp_path / "repo", **repository))


def test_version_folder_holds_the_served_precision_only(minilm_recipe, tmp_path: Path) -> None:
    artifacts = _all_precisions(tmp_path)
    recipe = _recipe(minilm_recipe, tmp_path, serve="int8")
    result = package_model(recipe, artifacts)
    files = {p.name for p in result.version_dir.iterdir() if p.is_file()}
    # No 7-bit INT8 form was built, so the FP32 ONNX model travels too: `auto` serves it on a CPU without integer
    # dot products (test_int8_without_its_7_bit_form_carries_the_fp32_model_for_cpus_without_dot_products).
    assert {n for n in files if n.startswith("model.") and n != "model.py"} == {
        "model.int8.onnx", "model.int8.onnx.data", "model.int8.plan", "model.int8.plan.json",
        "model.onnx", "model.onnx.data"}
    params = config_parameters(read_config(result.model_dir))
    assert (params["precision"], params["onnx_file"], params["plan_file"]) == ("int8", "model.int8.onnx",
                                                                              "model.int8.plan")
    meta = json.loads((result.version_dir / "metadata.json").read_text())
    assert meta["serve"] == {"precision": "int8", "onnx": "model.int8.onnx", "plan": "model.int8.plan"}
    assert meta["precisions"] == ["fp32", "fp16", "int8"] and meta["precisions_in_folder"] == ["fp32", "int8"]
    assert "model.int8.onnx.data" in meta["files"] and meta["engines"] == ["model.int8.plan"]
    # Weights are hard links to the build's files, not copies; small files are copies.
    data = result.version_dir / "model.int8.onnx.data"
    assert data.stat().st_ino == artifacts["model.int8.onnx"].with_name("model.int8.onnx.data").stat().st_ino
    assert (result.version_dir / "model.int8.onnx").stat().st_ino != artifacts["model.int8.onnx"].stat().st_ino


def test_keep_all_precisions_and_a_precision_without_plan(minilm_recipe, tmp_path: Path) -> None:
    artifacts = _all_precisions(tmp_path)
    result = package_model(_recipe(minilm_recipe, tmp_path, serve="fp16", keep_all_precisions=True), artifacts)
    files = {p.name for p in result.version_dir.iterdir()}
    assert set(artifacts) | {"model.onnx.data", "model.int8.onnx.data"} <= files
    params = config_parameters(read_config(result.model_dir))
    assert params["precision"] == "fp16" and params["onnx_file"] == "model.fp16.onnx" and "plan_file" not in params
    meta = json.loads((result.version_dir / "metadata.json").read_text())
    assert meta["serve"]["plan"] is None and meta["precisions_in_folder"] == ["fp32", "fp16", "int8"]


def test_serving_a_precision_that_was_not_built_is_refused(minilm_recipe, tmp_path: Path) -> None:
    artifacts = _all_precisions(tmp_path)
    del artifacts["model.int8.onnx"]
    with pytest.raises(FactoryError, match=r"serve = \"int8\".*not built. Fix: run model-factory quantize"):
        package_model(_recipe(minilm_recipe, tmp_path, serve="int8"), artifacts)




def test_a_queue_policy_on_one_instance_gets_a_note(minilm_recipe) -> None:
    """Triton's batcher loses wake-ups with a queue policy: a one-instance recipe that sets one is told."""
    from model_factory.build.repository import queue_policy_note

    assert queue_policy_note(minilm_recipe) is None  # the default: two instances, a bounded queue
    one = replace(minilm_recipe, repository=replace(minilm_recipe.repository, instance_count=1))
    note = queue_policy_note(one)  # "auto" on one instance: left unbounded, and told why
    assert note is not None and "unbounded" in note and "instance_count = 2" in note
    unbounded = replace(one, batching=replace(one.batching, max_queue_size=0))
    assert queue_policy_note(unbounded) is None  # asked for no policy, and has none
    for field, value in (("max_queue_size", 64), ("queue_timeout_us", 1000), ("priority_levels", 2)):
        bounded = replace(one, batching=replace(one.batching, **{field: value}))
        note = queue_policy_note(bounded)
        assert note is not None and "instance_count = 2" in note and "500 ms" in note
        two = replace(bounded, repository=replace(bounded.repository, instance_count=2))
        assert queue_policy_note(two) is None


def test_the_7_bit_int8_form_travels_with_the_served_int8_only(minilm_recipe, tmp_path: Path) -> None:
    from model_factory.backend.contract import Files, file_precision
    from model_factory.build.repository import select_artifacts

    assert file_precision(Files.INT8_7BIT) == "int8" and file_precision(Files.INT8_7BIT + ".data") == "int8"
    files = {}
    for name in ("model.onnx", "model.int8.onnx", Files.INT8_7BIT):
        files[name] = tmp_path / name
        files[name].write_bytes(b"x")
    (tmp_path / (Files.INT8_7BIT + ".data")).write_bytes(b"w")
    fp32 = select_artifacts(minilm_recipe, files)
    assert set(fp32) == {"model.onnx"}
    int8 = select_artifacts(replace(minilm_recipe, precisions=("fp32", "int8"), repository=replace(
        minilm_recipe.repository, serve="int8")), files)
    assert set(int8) == {"model.int8.onnx", Files.INT8_7BIT, Files.INT8_7BIT + ".data"}


def test_int8_without_its_7_bit_form_carries_the_fp32_model_for_cpus_without_dot_products(minilm_recipe,
                                                                                          tmp_path: Path) -> None:
    """Where the 7-bit weights missed the gate, `auto` serves FP32 on an AVX2-only CPU (Q/DQ simulated in float is
    never faster than FP32): the FP32 model travels with the INT8 one. A pinned int8_kernels never uses it."""
    from model_factory.build.repository import select_artifacts

    files = {}
    for name in ("model.onnx", "model.int8.onnx", "model.fp16.onnx"):
        files[name] = tmp_path / name
        files[name].write_bytes(b"x")
    int8 = replace(minilm_recipe, precisions=("fp32", "fp16", "int8"),
                   repository=replace(minilm_recipe.repository, serve="int8"))
    assert set(select_artifacts(int8, files)) == {"model.int8.onnx", "model.onnx"}
    pinned = replace(int8, repository=replace(int8.repository, int8_kernels="simulated"))
    assert set(select_artifacts(pinned, files)) == {"model.int8.onnx"}
    fp16 = replace(int8, repository=replace(int8.repository, serve="fp16"))
    assert set(select_artifacts(fp16, files)) == {"model.fp16.onnx"}
