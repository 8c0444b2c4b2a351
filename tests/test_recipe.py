"""Recipe validation: good recipes parse into dataclasses, bad ones name the field and the fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from model_factory.errors import FactoryError
from model_factory.recipe import load_recipe, parse_recipe

ONNX_RECIPE = """
[model]
name = "tiny"
version = 2
task = "generic"

[source]
kind = "onnx"
path = "tiny.onnx"

[[inputs]]
name = "x"
dtype = "fp32"
dims = [-1]

[[outputs]]
name = "y"
dtype = "FP32"
dims = [-1]

[shapes]
max_batch = 8
max_sequence_length = 64
sequence_buckets = [16, 64]
"""


@pytest.fixture
def onnx_recipe_dir(tmp_path: Path) -> Path:
    (tmp_path / "tiny.onnx").write_bytes(b"placeholder")  # parse checks existence only
    (tmp_path / "recipe.toml").write_text(ONNX_RECIPE)
    return tmp_path


def test_onnx_recipe_parses_with_paths_relative_to_recipe(onnx_recipe_dir: Path) -> None:
    r = load_recipe(onnx_recipe_dir / "recipe.toml")
    assert r.name == "tiny" and r.version == 2 and r.task == "generic"
    assert r.source.path == onnx_recipe_dir / "tiny.onnx"
    assert r.inputs[0].dtype == "FP32" and r.inputs[0].dims == (-1,)
    assert r.shapes.sequence_buckets == (16, 64)
    assert r.repository.path == onnx_recipe_dir / "model_repository"
    assert r.precisions == ("fp32",)
    with pytest.raises(AttributeError):
        r.name = "other"  # frozen


def test_example_recipe_infers_hf_inputs_and_outputs() -> None:
    r = load_recipe(Path(__file__).resolve().parents[1] / "model_factory" / "examples" / "minilm.toml")
    names = [s.name for s in r.inputs]
    assert names[:2] == ["input_ids", "attention_mask"] and "text" in names
    assert {o.name: o.dims for o in r.outputs} == {"last_hidden_state": (-1, 384), "embedding": (384,)}
    assert r.is_text_model


def _data() -> dict:
    return {"model": {"name": "m"}, "source": {"kind": "onnx", "path": "tiny.onnx"},
            "inputs": [{"name": "x", "dtype": "FP32", "dims": [-1]}],
            "outputs": [{"name": "y", "dtype": "FP32", "dims": [-1]}]}


@pytest.mark.parametrize("mutate, field, fix", [
    (lambda d: d["model"].update(name="bad name!"), "model.name", "letters"),
    (lambda d: d["model"].update(version=0), "model.version", "greater than 0"),
    (lambda d: d["model"].update(colour="red"), "model.colour", "remove it"),
    (lambda d: d["source"].update(kind="tflite"), "source.kind", "huggingface"),
    (lambda d: d["source"].update(path="missing.onnx"), "source.path", "existing .onnx"),
    (lambda d: d.update(shapes={"max_batch": -1}), "shapes.max_batch", "greater than 0"),
    (lambda d: d.update(shapes={"max_batch": True}), "shapes.max_batch", "number"),
    (lambda d: d.update(shapes={"max_sequence_length": 128, "sequence_buckets": [64, 32, 128]}),
     "shapes.sequence_buckets", "smallest first"),
    (lambda d: d.update(shapes={"max_sequence_length": 128, "sequence_buckets": [32, 64]}),
     "shapes.sequence_buckets", "end the list"),
    (lambda d: d.update(precisions=["fp16"]), "precisions", "keep \"fp32\""),
    (lambda d: d.update(precisions=["fp32", "int2"]), "precisions", "one of"),
    (lambda d: d.update(precisions=["fp32", "int8"]), "quantization.calibration_data", "local"),
    (lambda d: d.update(quantization={"min_accuracy": 1.5}), "quantization.min_accuracy", "(0, 1]"),
    (lambda d: d.update(precisions=["fp32", "fp16"]), "quantization.heldout_data", "local"),
    (lambda d: d.update(inputs=[{"name": "x", "dtype": "FP32", "dims": [0]}]), "inputs[0].dims", "positive"),
    (lambda d: d.update(inputs=[{"name": "x", "dims": [-1]}]), "inputs[0].dtype", "add dtype"),
    (lambda d: d.update(batching={"preferred_batch_sizes": [64]}), "batching.preferred_batch_sizes", "max_batch"),
    (lambda d: d.update(export={"opset": 9}), "export.opset", "between 13 and 21"),
    (lambda d: d.update(tensorrt={"optimization_level": 9}), "tensorrt.optimization_level", "0..5"),
    (lambda d: d.update(export={"torchscript": "yes"}), "export.torchscript", "true or false"),
    (lambda d: d.update(export={"torchscript": 1}), "export.torchscript", "true or false"),
    (lambda d: d.update(export={"torchscript": True}), "export.torchscript", "export.torchscript = false"),
    (lambda d: d.update(batching={"max_group_tokens": 10}), "batching.max_group_tokens", "at least 128"),
    (lambda d: d.update(batching={"max_group_tokens": "lots"}), "batching.max_group_tokens", "whole number"),
    (lambda d: d.update(batching={"max_queue_size": -1}), "batching.max_queue_size", "unbounded"),
    (lambda d: d.update(batching={"max_queue_size": "lots"}), "batching.max_queue_size", '"auto"'),
    (lambda d: d.update(repository={"cpu_threads": -2}), "repository.cpu_threads", "split the cores"),
    (lambda d: d.update(batching={"timeout_action": "drop"}), "batching.timeout_action", "reject, delay"),
    (lambda d: d.update(batching={"queue_timeout_us": 1.5}), "batching.queue_timeout_us", "microseconds"),
    (lambda d: d.update(batching={"shed_by": "size"}), "batching.shed_by", "count, age"),
    (lambda d: d.update(batching={"shed_by": "age", "max_queue_size": 64}), "batching.shed_by",
     'max_queue_size = "auto"'),
    (lambda d: d.update(batching={"shed_by": "age", "queue_timeout_us": 1000}), "batching.shed_by",
     "remove queue_timeout_us"),
    (lambda d: d.update(batching={"priority_levels": 2, "default_priority": 3}), "batching.default_priority",
     "between 1 and priority_levels"),
    (lambda d: d.update(batching={"default_priority": 1}), "batching.default_priority", "priority_levels"),
    (lambda d: d.update(repository={"engine": "tflite"}), "repository.engine", "one of"),
    (lambda d: d.update(repository={"engine": "torch"}), "repository.engine", "export.torchscript = true"),
    (lambda d: d.update(repository={"engine": "tensorrt"}), "repository.engine", "tensorrt.enabled = true"),
    (lambda d: d.update(repository={"serve": "int4"}), "repository.serve", "one of"),
    (lambda d: d.update(repository={"serve": "int8"}), "repository.serve", "add \"int8\" to precisions"),
    (lambda d: d.update(repository={"keep_all_precisions": "yes"}), "repository.keep_all_precisions", "true"),
    (lambda d: d.update(export={"dynamo": "yes"}), "export.dynamo", "choose by model size"),
])
def test_bad_recipe_names_field_and_fix(onnx_recipe_dir: Path, mutate, field: str, fix: str) -> None:
    data = _data()
    mutate(data)
    with pytest.raises(FactoryError) as info:
        parse_recipe(data, onnx_recipe_dir)
    msg = str(info.value)
    assert f"'{field}'" in msg and "Fix:" in msg and fix in msg


def test_the_default_sheds_by_age_where_the_bound_is_auto_and_as_given_elsewhere(onnx_recipe_dir: Path) -> None:
    """shed_by defaults to "age" on an "auto" bound; a fixed bound or a queue timeout of the recipe's own is kept
    as given ("count"), where "age" named outright is an error (above)."""
    assert parse_recipe(_data(), onnx_recipe_dir).batching.shed_by == "age"
    for given in ({"max_queue_size": 64}, {"queue_timeout_us": 1000}):
        data = _data()
        data["batching"] = dict(given)
        assert parse_recipe(data, onnx_recipe_dir).batching.shed_by == "count"
    data = _data()
    data["batching"] = {"shed_by": "count"}
    assert parse_recipe(data, onnx_recipe_dir).batching.shed_by == "count"


def test_torch_source_requires_declared_io(tmp_path: Path) -> None:
    with pytest.raises(FactoryError, match="'inputs'.*declared"):
        parse_recipe({"model": {"name": "m"}, "source": {"kind": "torch", "factory": "pkg.mod:make"}}, tmp_path)


def test_torch_factory_needs_colon(tmp_path: Path) -> None:
    with pytest.raises(FactoryError, match="source.factory"):
        parse_recipe({"model": {"name": "m"}, "source": {"kind": "torch", "factory": "pkg.mod.make"}}, tmp_path)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(FactoryError, match="does not exist"):
        load_recipe(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nname = 1")
    with pytest.raises(FactoryError, match="not valid TOML"):
        load_recipe(bad)
    bad.write_bytes(b"[model]\nname = \"\xff\xfe\"\n")  # not UTF-8: a clean error, not a traceback
    with pytest.raises(FactoryError, match="not valid TOML"):
        load_recipe(bad)


def test_hf_folder_without_config_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    with pytest.raises(FactoryError, match="config.json"):
        parse_recipe({"model": {"name": "m"}, "source": {"kind": "huggingface", "path": "model"}}, tmp_path)


def test_overrides_apply(onnx_recipe_dir: Path) -> None:
    r = load_recipe(onnx_recipe_dir / "recipe.toml", {"repository.path": "/tmp/elsewhere", "model.version": 7})
    assert r.repository.path == Path("/tmp/elsewhere") and r.version == 7


def test_export_torchscript_option(tmp_path: Path) -> None:
    torch_source = {"model": {"name": "m"}, "source": {"kind": "torch", "factory": "pkg.mod:make"},
                    "inputs": [{"name": "x", "dtype": "FP32", "dims": [-1]}],
                    "outputs": [{"name": "y", "dtype": "FP32", "dims": [-1]}]}
    assert parse_recipe(torch_source, tmp_path).export.torchscript is False  # default: off
    on = parse_recipe({**torch_source, "export": {"torchscript": True}}, tmp_path)
    assert on.export.torchscript is True and on.export.opset == 17
    off = parse_recipe({**torch_source, "export": {"torchscript": False, "dynamo": True}}, tmp_path)
    assert off.export.torchscript is False and off.export.dynamo is True


def test_repository_engine_option(tmp_path: Path) -> None:
    torch_source = {"model": {"name": "m"}, "source": {"kind": "torch", "factory": "pkg.mod:make"},
                    "inputs": [{"name": "x", "dtype": "FP32", "dims": [-1]}],
                    "outputs": [{"name": "y", "dtype": "FP32", "dims": [-1]}]}
    assert parse_recipe(torch_source, tmp_path).repository.engine == "auto"
    on = parse_recipe({**torch_source, "export": {"torchscript": True}, "repository": {"engine": "torch"}}, tmp_path)
    assert on.repository.engine == "torch"
    trt = parse_recipe({**torch_source, "tensorrt": {"enabled": True}, "repository": {"engine": "tensorrt"}}, tmp_path)
    assert trt.repository.engine == "tensorrt"


def test_repository_allow_cpu_fallback_option(tmp_path: Path) -> None:
    from model_factory.errors import FactoryError

    torch_source = {"model": {"name": "m"}, "source": {"kind": "torch", "factory": "pkg.mod:make"},
                    "inputs": [{"name": "x", "dtype": "FP32", "dims": [-1]}],
                    "outputs": [{"name": "y", "dtype": "FP32", "dims": [-1]}]}
    assert parse_recipe(torch_source, tmp_path).repository.allow_cpu_fallback is False  # default: refuse
    on = parse_recipe({**torch_source, "repository": {"allow_cpu_fallback": True}}, tmp_path)
    assert on.repository.allow_cpu_fallback is True
    with pytest.raises(FactoryError, match=r"'repository.allow_cpu_fallback'.*Fix: write true or false"):
        parse_recipe({**torch_source, "repository": {"allow_cpu_fallback": "yes"}}, tmp_path)
# --------------------------------------------------------------------------- Hugging Face tasks

HF_TASK_RECIPE = """
[model]
name = "m"
task = "{task}"

[source]
kind = "huggingface"
path = "hf"
{extra}
"""


def _hf_folder(tmp_path: Path, architectures: list[str], **cfg) -> Path:
    import json

    folder = tmp_path / "hf"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": architectures, "hidden_size": 32,
                                                    "type_vocab_size": 2, **cfg}))
    return folder


def _task_recipe(tmp_path: Path, task: str, extra: str = ""):
    (tmp_path / "r.toml").write_text(HF_TASK_RECIPE.format(task=task, extra=extra))
    return load_recipe(tmp_path / "r.toml")


def test_classification_outputs_logits_and_probabilities_with_labels(tmp_path: Path) -> None:
    _hf_folder(tmp_path, ["DistilBertForSequenceClassification"], id2label={"0": "neg", "1": "pos"})
    r = _task_recipe(tmp_path, "classification", "[classification]\nprobabilities = true\n")
    assert [(o.name, o.dims) for o in r.outputs] == [("logits", (2,)), ("probabilities", (2,))]
    assert {i.name for i in r.inputs} == {"input_ids", "attention_mask", "token_type_ids", "text"}


def test_token_classification_outputs_per_token_logits(tmp_path: Path) -> None:
    _hf_folder(tmp_path, ["BertForTokenClassification"], id2label={str(i): f"L{i}" for i in range(5)})
    r = _task_recipe(tmp_path, "token-classification")
    assert [(o.name, o.dims) for o in r.outputs] == [("logits", (-1, 5))]


def test_reranker_takes_query_and_passage_and_returns_one_score(tmp_path: Path) -> None:
    _hf_folder(tmp_path, ["BertForSequenceClassification"], id2label={"0": "LABEL_0"})
    r = _task_recipe(tmp_path, "reranker")
    assert [(o.name, o.dims) for o in r.outputs] == [("score", (1,))]
    assert [i.name for i in r.inputs if i.dtype == "BYTES"] == ["query", "passage"]
    assert "token_type_ids" in [i.name for i in r.inputs]


@pytest.mark.parametrize("task, archs, cfg, needle", [
    ("classification", ["BertModel"], {}, "needs a sequence-classification head"),
    ("token-classification", ["BertForSequenceClassification"], {"id2label": {"0": "a", "1": "b"}},
     "needs a token-classification head"),
    ("reranker", ["BertForSequenceClassification"], {"id2label": {"0": "a", "1": "b"}}, "has 2 labels"),
    ("classification", [], {}, "no architectures entry"),
])
def test_folder_without_the_tasks_head_is_refused(tmp_path: Path, task, archs, cfg, needle) -> None:
    _hf_folder(tmp_path, archs, **cfg)
    with pytest.raises(FactoryError, match=needle) as info:
        _task_recipe(tmp_path, task)
    assert "'model.task'" in str(info.value) and "Fix:" in str(info.value)


def test_probabilities_only_for_classifiers(tmp_path: Path) -> None:
    _hf_folder(tmp_path, ["BertModel"])
    with pytest.raises(FactoryError, match="classification.probabilities"):
        _task_recipe(tmp_path, "embedding", "[classification]\nprobabilities = true\n")


def test_served_precision_defaults_to_fp32_and_is_the_users_choice(onnx_recipe_dir: Path) -> None:
    default = parse_recipe(_data(), onnx_recipe_dir).repository
    assert default.serve == "fp32" and default.keep_all_precisions is False
    data = _data() | {"precisions": ["fp32", "fp16"], "quantization": {"heldout_data": "tiny.onnx"},
                      "repository": {"serve": "fp16", "keep_all_precisions": True}}
    chosen = parse_recipe(data, onnx_recipe_dir).repository
    assert chosen.serve == "fp16" and chosen.keep_all_precisions is True


def test_torch_engine_serves_only_fp32(tmp_path: Path) -> None:
    data = {"model": {"name": "m"}, "source": {"kind": "torch", "factory": "pkg.mod:make"},
            "inputs": [{"name": "x", "dtype": "FP32", "dims": [-1]}],
            "outputs": [{"name": "y", "dtype": "FP32", "dims": [-1]}],
            "precisions": ["fp32", "fp16"], "quantization": {"heldout_data": "held.npz"},
            "export": {"torchscript": True}, "repository": {"engine": "torch", "serve": "fp16"}}
    (tmp_path / "held.npz").write_bytes(b"")
    with pytest.raises(FactoryError, match=r"'repository.serve'.*FP32 torch program.*Fix: set serve = \"fp32\""):
        parse_recipe(data, tmp_path)


def _two_input_onnx(path: Path, batch="batch") -> Path:
    """a: FP32 [batch, seq, 4], b: FP32 [batch, 4] -> y = a + b (per position): one dynamic axis."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Unsqueeze", ["b", "axes"], ["b3"]), helper.make_node("Add", ["a", "b3"], ["y"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [batch, "seq", 4]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [batch, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, "seq", 4])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_onnx_io_is_read_from_the_graph_when_not_declared(tmp_path: Path) -> None:
    _two_input_onnx(tmp_path / "m.onnx")
    r = parse_recipe({"model": {"name": "m", "task": "generic"}, "source": {"kind": "onnx", "path": "m.onnx"}},
                     tmp_path)
    assert [(s.name, s.dtype, s.dims) for s in r.inputs] == [("a", "FP32", (-1, 4)), ("b", "FP32", (4,))]
    assert [(s.name, s.dtype, s.dims) for s in r.outputs] == [("y", "FP32", (-1, 4))]
    assert r.batching.pad_sequences is False  # no attention mask: requests are never padded
    _two_input_onnx(tmp_path / "fixed.onnx", batch=1)
    with pytest.raises(FactoryError, match="axis 0 is not a dynamic batch axis. Fix: export the model with a dynamic"):
        parse_recipe({"model": {"name": "m"}, "source": {"kind": "onnx", "path": "fixed.onnx"}}, tmp_path)


def test_declared_onnx_io_is_checked_against_the_graph(tmp_path: Path) -> None:
    from model_factory.build_engines.export import export_model

    _two_input_onnx(tmp_path / "m.onnx")
    data = {"model": {"name": "m", "task": "generic"}, "source": {"kind": "onnx", "path": "m.onnx"},
            "inputs": [{"name": "a", "dtype": "FP16", "dims": [-1, 4]}, {"name": "b", "dtype": "FP32", "dims": [4]}],
            "outputs": [{"name": "y", "dtype": "FP32", "dims": [-1, 4]}]}
    with pytest.raises(FactoryError, match="'a' is FP16 but the ONNX graph's is FP32. Fix: declare dtype"):
        export_model(parse_recipe(data, tmp_path))
    data["inputs"][0] = {"name": "a", "dtype": "FP32", "dims": [-1, 5]}
    with pytest.raises(FactoryError, match=r"dims \[-1, 5\] but the ONNX graph's are \[-1, 4\]"):
        export_model(parse_recipe(data, tmp_path))
    data["inputs"][0] = {"name": "a", "dtype": "FP32", "dims": [16, 4]}  # a fixed size where the graph is dynamic
    assert export_model(parse_recipe(data, tmp_path)).input_names == ("a", "b")


def test_torch_source_with_path_instead_of_factory_says_so(tmp_path: Path) -> None:
    with pytest.raises(FactoryError, match="a torch source takes factory, not path.*factory = \"module:function\""):
        parse_recipe({"model": {"name": "m"}, "source": {"kind": "torch", "path": "tiny_cnn.py"}}, tmp_path)
    r = parse_recipe({"model": {"name": "m"}, "source": {"kind": "torch", "factory": "tiny_cnn:build"},
                      "inputs": [{"name": "pixels", "dtype": "UINT8", "dims": [3, 64, 64]}],
                      "outputs": [{"name": "logits", "dtype": "FP32", "dims": [10]}]}, tmp_path)
    assert r.source.base_dir == tmp_path and r.inputs[0].dtype == "UINT8"


def test_readme_recipes_for_every_hugging_face_task_parse(tmp_path: Path) -> None:
    """README's short recipes (built verbatim by the zoo) parse, each with its task's outputs."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from zoo_models import readme_recipe

    heads = {"embedding": ["BertModel"], "classification": ["DistilBertForSequenceClassification"],
             "token-classification": ["BertForTokenClassification"], "reranker": ["BertForSequenceClassification"]}
    outputs = {"embedding": ["last_hidden_state", "embedding"], "classification": ["logits", "probabilities"],
               "token-classification": ["logits"], "reranker": ["score"]}
    for task, archs in heads.items():
        text = readme_recipe(task)
        folder = tmp_path / task
        folder.mkdir()
        path = re.search(r'^path = "([^"]+)"', text, re.M).group(1)
        (folder / path).mkdir()
        labels = {"0": "only"} if task == "reranker" else {"0": "a", "1": "b"}
        (folder / path / "config.json").write_text(json.dumps({"architectures": archs, "hidden_size": 8,
                                                               "id2label": labels}))
        for name in ("calib.txt", "heldout.txt", "pairs.jsonl", "heldout_pairs.jsonl"):
            (folder / name).write_text("x\n")
        (folder / "r.toml").write_text(text)
        recipe = load_recipe(folder / "r.toml")
        assert recipe.task == task and [o.name for o in recipe.outputs] == outputs[task]
        assert recipe.precisions == ("fp32", "fp16", "int8") and recipe.quantization.min_accuracy == 0.99


def test_every_readme_recipe_is_toml_with_known_tables() -> None:
    """README's recipe blocks are valid TOML, with every key in the table the recipe reads it from."""
    import tomllib

    from model_factory.errors import FactoryError as _Err
    from model_factory.recipe import parse_recipe as _parse

    root = Path(__file__).resolve().parents[1]
    blocks = [b for doc in (root / "README.md", root / "docs" / "models.md")
              for b in re.findall(r"```toml\n(.*?)```", doc.read_text(), re.S)]
    assert len(blocks) >= 7
    for block in blocks:
        data = tomllib.loads(block)
        try:
            _parse(data, Path("/nonexistent"))
        except _Err as exc:  # the files the recipe names are not here; a misplaced key fails before them
            assert "unknown key" not in str(exc), (str(exc), block)


def test_exporter_is_chosen_by_size_unless_the_recipe_says(onnx_recipe_dir: Path) -> None:
    from model_factory.build_engines.export import DYNAMO_MIN_PARAMETERS, use_dynamo

    unset = parse_recipe(_data(), onnx_recipe_dir)
    assert unset.export.dynamo is None
    assert not use_dynamo(unset, DYNAMO_MIN_PARAMETERS - 1) and use_dynamo(unset, DYNAMO_MIN_PARAMETERS)
    for choice in (True, False):
        chosen = parse_recipe(_data() | {"export": {"dynamo": choice}}, onnx_recipe_dir)
        assert use_dynamo(chosen, 10) is choice and use_dynamo(chosen, 10**10) is choice




def test_matryoshka_dimensions_only_on_embedding_models(tmp_path: Path) -> None:
    _hf_folder(tmp_path, ["BertModel"])
    r = _task_recipe(tmp_path, "embedding", "[embedding]\nmatryoshka_dimensions = [16, 8, 16]\n")
    assert r.matryoshka_dimensions == (8, 16)
    assert _task_recipe(tmp_path, "embedding").matryoshka_dimensions == ()
    _hf_folder(tmp_path, ["BertForSequenceClassification"], num_labels=1)
    with pytest.raises(FactoryError, match="embedding.matryoshka_dimensions"):
        _task_recipe(tmp_path, "reranker", "[embedding]\nmatryoshka_dimensions = [8]\n")
