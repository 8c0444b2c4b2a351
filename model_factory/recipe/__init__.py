"""The recipe: every setting for one model build, parsed once into frozen dataclasses.

A recipe is a TOML file. Its shape is one pydantic schema (``schema``: strict types, choices, ranges,
no unknown keys), published as JSON Schema for editors (``model-factory schema``). ``loading`` reads
the TOML, checks it against the schema and what needs several keys or the filesystem, and returns a
:class:`Recipe` (``specs``); ``huggingface`` and ``onnx_io`` derive inputs and outputs from the model.
Relative paths are resolved against the recipe's folder, so a recipe and its data travel together.
Every stage receives the part of the recipe it needs; nothing reads the environment.

A wrong recipe raises :class:`~model_factory.errors.FactoryError` naming the field (``section.key``),
the problem and the fix (``errors``).
"""

from __future__ import annotations

from model_factory.recipe.errors import field_error
from model_factory.recipe.huggingface import (TASK_HEADS, check_hf_task, hf_labels, hf_tensor_specs, read_hf_config,
                                              resolve_package_model)
from model_factory.recipe.loading import load_recipe, parse_recipe, validate_recipe_data
from model_factory.recipe.onnx_io import graph_tensor_specs, onnx_tensor_specs
from model_factory.recipe.schema import (CALIBRATION_METHODS, DTYPES, ENGINES, GROUPING_MODES, INSTANCE_KINDS,
                                         ONNX_DTYPES, PRECISIONS, SOURCE_KINDS, TASKS, recipe_json_schema)
from model_factory.recipe.specs import (AdapterBase, BatchingSpec, ExportSpec, QuantizationSpec, Recipe,
                                        RepositorySpec, ShapeSpec, SourceSpec, TensorRTSpec, TensorSpec)

__all__ = [
    "AdapterBase", "BatchingSpec", "CALIBRATION_METHODS", "DTYPES", "ENGINES", "ExportSpec", "GROUPING_MODES",
    "INSTANCE_KINDS", "ONNX_DTYPES", "PRECISIONS", "QuantizationSpec", "Recipe", "RepositorySpec", "SOURCE_KINDS",
    "ShapeSpec",
    "SourceSpec", "TASKS", "TASK_HEADS", "TensorRTSpec", "TensorSpec", "check_hf_task", "field_error",
    "graph_tensor_specs", "hf_labels", "hf_tensor_specs", "load_recipe", "onnx_tensor_specs", "parse_recipe",
    "read_hf_config", "recipe_json_schema", "resolve_package_model", "validate_recipe_data",
]
