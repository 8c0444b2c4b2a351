"""Property-based: recipes generated from the published JSON Schema.

* one key of a good recipe set to any TOML value the schema forbids (another type, out of range, not one
  of the choices, an unknown key) is refused with a FactoryError naming exactly that field, never another
  exception;
* tables drawn from the schema pass the schema layer (the JSON Schema and the pydantic models agree), and
  parse into a Recipe holding the drawn values, unless a check across keys refuses them with a FactoryError.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from recipe_leaves import SCHEMA, base_recipe, leaves, recipe_folder, tables, with_value

from model_factory.errors import FactoryError
from model_factory.recipe import Recipe, parse_recipe, validate_recipe_data

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow,
                                                                        HealthCheck.filter_too_much])
LEAVES = leaves()

# What tomllib can hand us: strings, integers, floats (nan and inf included), booleans, dates and times,
# arrays, tables.
_scalars = st.one_of(st.booleans(), st.integers(), st.integers(-3, 300), st.datetimes(), st.dates(), st.times(),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                     st.sampled_from(["auto", "true", "false", "fp32", "FP32", "1", "-1", "0", ""]))
TOML_VALUES = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                           max_leaves=6)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return recipe_folder(tmp_path_factory.mktemp("recipe"))


def _forbidden(leaf, value: Any) -> bool:
    # jsonschema compares nan as unequal to everything: nan never satisfies a bound, as in pydantic.
    return not jsonschema.Draft7Validator(leaf.validator_schema()).is_valid(value)


@st.composite
def _wrong_key(draw):
    leaf = draw(st.sampled_from(LEAVES))
    value = draw(TOML_VALUES.filter(lambda v: _forbidden(leaf, v)))
    return leaf, value


@FAST
@given(case=_wrong_key())
def test_a_value_the_schema_forbids_is_refused_naming_its_field(folder: Path, case) -> None:
    leaf, value = case
    data = with_value(base_recipe(), leaf.path, value)
    try:
        parse_recipe(data, folder)
    except FactoryError as exc:
        msg = str(exc)
        assert msg.startswith(f"recipe field '{leaf.label}': ") and ". Fix: " in msg, (leaf.label, value, msg)
        assert "\n" not in msg and len(msg) < 600, msg
    else:
        raise AssertionError(f"{leaf.label} = {value!r} was accepted")


_TABLE_NAMES = sorted(t for t in tables() if t not in ("inputs", "outputs"))


@st.composite
def _unknown_key(draw):
    table = draw(st.sampled_from(["", *_TABLE_NAMES]))
    known = SCHEMA["properties"] if not table else tables()[table]["properties"]
    key = draw(st.from_regex(r"[a-z_]{1,12}", fullmatch=True).filter(lambda k: k not in known))
    return table, key, draw(TOML_VALUES)


@FAST
@given(case=_unknown_key())
def test_an_unknown_key_is_refused_naming_it(folder: Path, case) -> None:
    table, key, value = case
    data = with_value(base_recipe(), (table, key) if table else (key,), value)
    with pytest.raises(FactoryError, match=r"^recipe field '" + (f"{table}." if table else "") + key +
                       "': unknown key. Fix: remove it or use one of: "):
        parse_recipe(data, folder)


# --------------------------------------------------------------------------- schema-valid recipes

# The fields the checks across keys (and of files) name: the only refusals a schema-valid recipe may get.
ACROSS_KEYS = {"precisions", "shapes.sequence_buckets", "batching.preferred_batch_sizes", "batching.max_group_tokens",
               "batching.default_priority", "quantization.calibration_data", "quantization.heldout_data",
               "export.torchscript", "repository.engine", "repository.serve", "repository.degrade_to", "batching.shed_by",
               "classification.probabilities",
               "shapes.long_inputs", "shapes.chunk_overlap",
               # text-generation: only for a Hugging Face causal-LM folder; its keys refused on other tasks
               "source.kind", "inputs", "shapes.max_context", "generation", "quantization.kv_cache"}
# Keys whose recipe value is not the Recipe's attribute as is (paths resolved, "auto", derived defaults).
_NOT_AS_IS = {"path", "calibration_data", "heldout_data", "timing_cache", "max_queue_size", "text_input",
              "default_priority", "pad_sequences", "preferred_batch_sizes", "sequence_buckets",
              "max_perplexity_ratio", "min_token_agreement", "matryoshka_dimensions"}
_WHERE = {"model": lambda r: r, "embedding": lambda r: r, "shapes": lambda r: r.shapes, "export": lambda r: r.export,
          "quantization": lambda r: r.quantization, "tensorrt": lambda r: r.tensorrt,
          "batching": lambda r: r.batching, "repository": lambda r: r.repository}


@st.composite
def _table(draw, name: str) -> dict[str, Any]:
    """Some keys of one table, each value drawn from the key's JSON Schema."""
    properties = tables()[name]["properties"]
    keys = draw(st.lists(st.sampled_from(sorted(properties)), unique=True, max_size=len(properties)))
    table = {key: draw(from_schema(properties[key])) for key in keys}
    if name == "quantization":  # data files must exist: name the folder's own
        table.update({k: "calib.txt" for k in ("calibration_data", "heldout_data") if k in table})
    return table


@st.composite
def _valid_recipe(draw):
    data = base_recipe()
    for name in draw(st.lists(st.sampled_from(list(_WHERE)), unique=True, min_size=1, max_size=3)):
        table = draw(_table(name))
        data[name] = {**data.get(name, {}), **table}
    if draw(st.booleans()):
        data["precisions"] = draw(from_schema(SCHEMA["properties"]["precisions"]))
    return data


@FAST
@given(data=_valid_recipe())
def test_a_recipe_the_schema_allows_passes_the_schema_and_keeps_its_values(folder: Path, data) -> None:
    # Strings a regex accepts before a final newline are a generator artefact: JSON Schema's $ is the end.
    name = data["model"]["name"]
    if name.endswith("\n"):
        return
    assert jsonschema.Draft7Validator(SCHEMA).is_valid(data)
    validate_recipe_data(data)  # never refused by the schema layer
    try:
        recipe = parse_recipe(data, folder)
    except FactoryError as exc:  # a check across keys (buckets vs length, serve vs precisions, ...)
        assert str(exc).startswith("recipe field '") and ". Fix: " in str(exc)
        assert str(exc).split("'")[1] in ACROSS_KEYS, str(exc)
        event(f"refused across keys: {str(exc).split(chr(39))[1]}")
        return
    event("parsed")
    assert isinstance(recipe, Recipe)
    for table, where in _WHERE.items():
        for key, value in data.get(table, {}).items():
            if key in _NOT_AS_IS or (table == "model" and key != "version" and key != "task"):
                continue
            got = getattr(where(recipe), key)
            assert got == value or (isinstance(value, float) and math.isclose(got, value)), (table, key, value, got)
