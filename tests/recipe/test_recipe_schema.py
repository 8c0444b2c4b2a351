"""The recipe schema: wrong types refused with the field and the fix, the published schema and docs equal to
what the code makes, and every recipe the project ships or builds valid against it."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import tomllib
from click.testing import CliRunner
from recipe_leaves import SCHEMA, Leaf, base_recipe, leaves, recipe_folder, with_value

from model_factory.cli.main import main
from model_factory.errors import FactoryError
from model_factory.recipe import load_recipe, parse_recipe, validate_recipe_data
from model_factory.recipe.reference import BEGIN, END, reference_markdown, schema_text

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return recipe_folder(tmp_path)


def _refusal(data: dict[str, Any], folder: Path) -> str:
    with pytest.raises(FactoryError) as info:
        parse_recipe(data, folder)
    return str(info.value)


# --------------------------------------------------------------------------- the bugs of issue 19


def test_a_string_false_is_not_true(folder: Path) -> None:
    """`normalize = "false"` was read as True (bool("false")); now it is refused, naming field and fix."""
    (folder / "r.toml").write_text('[model]\nname = "m"\n[source]\nkind = "onnx"\npath = "tiny.onnx"\n'
                                   '[[inputs]]\nname = "x"\ndtype = "FP32"\ndims = [-1]\n'
                                   '[[outputs]]\nname = "y"\ndtype = "FP32"\ndims = [-1]\n'
                                   '[embedding]\nnormalize = "false"\n')
    with pytest.raises(FactoryError) as info:
        load_recipe(folder / "r.toml")
    assert str(info.value) == ("recipe field 'embedding.normalize': expected true or false, got 'false'. "
                               "Fix: write true or false")
    assert parse_recipe(with_value(base_recipe(), ("embedding", "normalize"), False), folder).normalize is False


def test_package_with_a_non_number_pool_size_is_one_line(folder: Path) -> None:
    """`memory_pool_initial_mib = "abc"` ended `model-factory package` with a ValueError traceback."""
    text = ('[model]\nname = "m"\n[source]\nkind = "onnx"\npath = "tiny.onnx"\n'
            '[[inputs]]\nname = "x"\ndtype = "FP32"\ndims = [-1]\n[[outputs]]\nname = "y"\ndtype = "FP32"\n'
            'dims = [-1]\n[repository]\nmemory_pool_initial_mib = "abc"\n')
    (folder / "r.toml").write_text(text)
    result = CliRunner().invoke(main, ["package", str(folder / "r.toml")])
    assert result.exit_code == 1
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert lines == ["Error: recipe field 'repository.memory_pool_initial_mib': expected a whole number, got 'abc'. "
                     "Fix: give a whole number of MiB (0: none)"], result.output
    assert "Traceback" not in result.output


def _wrong_values(leaf: Leaf) -> list[Any]:
    """Values of another TOML type than the key takes (what bool(...) / int(...) used to coerce)."""
    kinds = {leaf.schema.get("type")} | {n.get("type") for n in leaf.schema.get("anyOf", [])}
    out: list[Any] = []
    if "boolean" in kinds:
        out += ["false", "true", 0, 1]
    if "integer" in kinds:
        out += ["1", "abc", True, 1.5]
    if "number" in kinds:
        out += ["0.5", False]
    if "string" in kinds:
        out += [5, True, ["x"]]
    if "array" in kinds:
        out += ["fp32" if leaf.label == "precisions" else "x", 7]
    return [v for v in out if not jsonschema.Draft7Validator(leaf.validator_schema()).is_valid(v)]


WRONG = [(leaf, value) for leaf in leaves() for value in _wrong_values(leaf)]


@pytest.mark.parametrize("leaf, value", WRONG, ids=[f"{leaf.label}={value!r}" for leaf, value in WRONG])
def test_every_key_refuses_a_value_of_another_type(folder: Path, leaf: Leaf, value: Any) -> None:
    msg = _refusal(with_value(base_recipe(), leaf.path, value), folder)
    assert msg.startswith(f"recipe field '{leaf.label}': ") and ". Fix: " in msg, msg


def test_every_key_is_covered_by_a_wrong_type(folder: Path) -> None:
    assert {leaf.label for leaf, _ in WRONG} == {leaf.label for leaf in leaves()}


def test_unknown_keys_name_the_keys_of_their_table(folder: Path) -> None:
    msg = _refusal(with_value(base_recipe(), ("batching", "max_queue_sise"), 8), folder)
    assert msg.startswith("recipe field 'batching.max_queue_sise': unknown key. Fix: remove it or use one of: ")
    assert "max_queue_size" in msg
    msg = _refusal(with_value(base_recipe(), ("inputs", 0, "shape"), [1]), folder)
    assert msg.startswith("recipe field 'inputs[0].shape': unknown key") and "dims" in msg


def test_optional_is_a_documented_input_key(folder: Path) -> None:
    recipe = parse_recipe(with_value(base_recipe(), ("inputs", 0, "optional"), True), folder)
    assert recipe.inputs[0].optional is True
    assert "optional" in SCHEMA["$defs"]["TensorTable"]["properties"]
    assert "| `optional` |" in (DOCS / "recipes.md").read_text()


def test_lower_case_dtypes_still_parse(folder: Path) -> None:
    assert parse_recipe(with_value(base_recipe(), ("inputs", 0, "dtype"), "int64"), folder).inputs[0].dtype == "INT64"


# --------------------------------------------------------------------------- published forms


def test_schema_command_prints_the_published_schema(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["schema"])
    assert result.exit_code == 0, result.output
    assert result.output == (DOCS / "recipe.schema.json").read_text() == schema_text(), (
        "docs/recipe.schema.json is stale: run python -m model_factory.recipe.reference")
    out = tmp_path / "sub" / "recipe.schema.json"
    result = CliRunner().invoke(main, ["schema", "-o", str(out)])
    assert result.exit_code == 0 and out.read_text() == schema_text()
    assert [p.name for p in out.parent.iterdir()] == ["recipe.schema.json"]  # no temporary file left
    jsonschema.Draft7Validator.check_schema(json.loads(out.read_text()))


def test_docs_reference_is_generated_from_the_schema() -> None:
    doc = (DOCS / "recipes.md").read_text()
    generated = doc.split(BEGIN + "\n", 1)[1].split(END, 1)[0]
    assert generated == reference_markdown(), "docs/recipes.md is stale: run python -m model_factory.recipe.reference"


def _properties(node: dict[str, Any], where: str):
    for key, sub in node.get("properties", {}).items():
        yield f"{where}.{key}" if where else key, sub


def test_every_key_has_a_description_and_a_row_in_the_docs() -> None:
    doc = (DOCS / "recipes.md").read_text()
    seen = 0
    for table, node in [("", SCHEMA), *SCHEMA["$defs"].items()]:
        assert table == "" or node.get("description"), table
        for where, sub in _properties(node, table):
            assert len(sub.get("description", "")) > 10, f"{where} has no description"
            key = where.rpartition(".")[2]
            heading = re.search(rf"^### `\[\[?{key}\]\]?`", doc, re.M)  # a table is a section of its own
            assert f"| `{key}` |" in doc or heading, f"{where} is not in docs/recipes.md"
            seen += 1
    assert seen > 60


# --------------------------------------------------------------------------- recipes shipped and built


def _module_string(path: Path, name: str) -> str:
    """A string constant of a test module, read without importing it (the module imports torch)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in {path}")


def _shipped_and_built_recipes() -> dict[str, dict[str, Any]]:
    sys.path.insert(0, str(ROOT / "tests"))
    from zoo_models import RANDOM_WEIGHT_GATE, RECIPE_TAIL, readme_recipe

    recipes = {"examples/minilm.toml": tomllib.loads((ROOT / "model_factory/examples/minilm.toml").read_text())}
    readme_blocks = [b for doc in (ROOT / "README.md", ROOT / "docs" / "models.md")
                     for b in re.findall(r"```toml\n(.*?)```", doc.read_text(), re.S)]
    # Whole recipes; a prompt template's (a [prompt] table) has its own schema: tests/build/test_prompt.py.
    for i, block in enumerate(b for b in readme_blocks if re.search(r"^\[model\]", b, re.M)
                              and not re.search(r"^\[prompt\]", b, re.M)):
        recipes[f"README/docs recipe {i}"] = tomllib.loads(block)
    for task in ("embedding", "classification", "token-classification", "reranker"):
        data = tomllib.loads(readme_recipe(task) + RECIPE_TAIL)
        for dotted, value in RANDOM_WEIGHT_GATE.items():
            section, _, key = dotted.partition(".")
            data[section][key] = value
        recipes[f"zoo {task}"] = data
    generic = ROOT / "tests" / "integration" / "test_zoo_generic.py"
    cnn = next(b for b in re.findall(r"```toml\n(.*?)```", (ROOT / "docs" / "models.md").read_text(), re.S)
               if 'factory = "tiny_cnn:build"' in b)
    recipes["zoo tiny-cnn"] = tomllib.loads(cnn + _module_string(generic, "CNN_RECIPE_TAIL").format(trt="true",
                                                                                                   repo="repo"))
    recipes["zoo two-inputs"] = tomllib.loads(_module_string(generic, "ONNX_RECIPE").format(trt="false", repo="repo"))
    return recipes


SHIPPED = _shipped_and_built_recipes()


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_and_zoo_recipes_fit_the_schema(name: str) -> None:
    """What users copy (the example, README's blocks) and what the zoo builds is valid for editors and for us."""
    data = SHIPPED[name]
    errors = sorted(jsonschema.Draft7Validator(json.loads((DOCS / "recipe.schema.json").read_text()))
                    .iter_errors(data), key=str)
    assert not errors, (name, [e.message for e in errors])
    validate_recipe_data(data)


def test_the_schema_refuses_what_the_loader_refuses() -> None:
    validator = jsonschema.Draft7Validator(SCHEMA)
    assert not validator.is_valid(with_value(base_recipe(), ("embedding", "normalize"), "false"))
    assert not validator.is_valid(with_value(base_recipe(), ("repository", "memory_pool_initial_mib"), "abc"))
    assert not validator.is_valid(with_value(base_recipe(), ("repository", "colour"), "red"))
    assert validator.is_valid(base_recipe())


@pytest.mark.parametrize("path", [("precisions",), ("shapes", "max_batch"), ("inputs", 0, "dims"), ("shapes",)])
def test_deeply_nested_values_are_refused_in_one_short_line(folder: Path, path: tuple) -> None:
    value: list = []
    for _ in range(20_000):  # deeper than Python's recursion limit: quoting it must not recurse
        value = [value]
    msg = _refusal(with_value(base_recipe(), path, value), folder)
    label = "inputs[0].dims" if path[0] == "inputs" else ".".join(path)
    assert msg.startswith(f"recipe field '{label}': ") and len(msg) < 300, msg
