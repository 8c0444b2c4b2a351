"""Recipe refusals: one :class:`FactoryError` naming the field (``section.key``), the problem and the fix.

Pydantic's :class:`~pydantic.ValidationError` is turned into that message here, so a user never sees
pydantic's wording or a traceback. The fix is the field's :class:`~model_factory.recipe.schema.Fix`
when it has one, else one derived from the kind of error.
"""

from __future__ import annotations

import reprlib
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from model_factory.errors import FactoryError
from model_factory.recipe.schema import Fix, RecipeFile

_KINDS = {"bool_type": "true or false", "int_type": "a whole number", "float_type": "a number",
          "string_type": "a string", "list_type": "an array", "model_type": "a table", "dict_type": "a table",
          "model_attributes_type": "a table"}


def field_error(where: str, problem: str, fix: str) -> FactoryError:
    """The one shape of a recipe refusal: ``recipe field 'where': problem. Fix: fix``."""
    return FactoryError(f"recipe field '{where}': {problem}. Fix: {fix}")


# A refused value is quoted short, whatever its size or depth (reprlib stops at maxlevel: no RecursionError).
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 3, 50, 50, 6, 4


def _short(value: Any, limit: int = 60) -> str:
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _models_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (directly, in a list or in an Optional), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (list, typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _models_in(arg)
            if found is not None:
                return found
    return None


def _locate(loc: tuple[Any, ...]) -> tuple[str, FieldInfo | None, Any, bool]:
    """The field a pydantic error location names: its label (``inputs[0].dims``), its FieldInfo, the table
    it sits in, and whether the location runs on below the field (an array item, a union member)."""
    label, model, info, table, deeper = "", RecipeFile, None, RecipeFile, False
    for i, part in enumerate(loc):
        if isinstance(part, int):
            # An index names a table in an array of tables ("inputs[0]"); an array of values keeps one label.
            if model is not None and i + 1 < len(loc) and isinstance(loc[i + 1], str):
                label += f"[{part}]"
            else:
                deeper = True
            continue
        if model is None:  # below a field of values: a union member's tag
            deeper = True
            break
        table = model
        label = f"{label}.{part}" if label else str(part)
        info = model.model_fields.get(part)
        if info is None:  # an unknown key
            break
        model = _models_in(info.annotation)
    return label, info, table, deeper


def _fix_of(info: FieldInfo | None) -> str | None:
    """The field's own Fix: the last one, as a field's own annotation comes after its type alias's."""
    fixes = [meta.text for meta in (info.metadata if info is not None else ()) if isinstance(meta, Fix)]
    return fixes[-1] if fixes else None


def _problem(err: dict[str, Any], union: bool) -> str:
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if kind == "missing":
        return "missing"
    if kind == "extra_forbidden":
        return "unknown key"
    if union or kind in ("literal_error", "enum", "string_pattern_mismatch"):
        return f"{_short(value)} is not allowed"
    if kind in _KINDS:
        return f"expected {_KINDS[kind]}, got {_short(value)}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        word = {"greater_than": "greater than", "greater_than_equal": ">=", "less_than": "less than",
                "less_than_equal": "<="}[kind]
        limit = next(iter(ctx.values()), "?")
        return f"must be {word} {limit}, got {_short(value)}"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "too_short":
        return "expected a non-empty list" if ctx.get("min_length") == 1 else f"too short: {_short(value)}"
    return f"{_short(value)} is not allowed ({err.get('msg', kind)})"


def _generic_fix(err: dict[str, Any], label: str, table: Any) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"remove it or use one of: {', '.join(sorted(table.model_fields))}"
    if kind == "missing":
        parent, _, key = label.rpartition(".")
        where = f"the [[{parent.partition('[')[0]}]] entry" if parent.endswith("]") else f"[{parent}]"
        return f"add {key} to the recipe" if not parent else f"add {key} to {where}"
    if kind == "bool_type":
        return "write true or false"
    return "see docs/recipes.md for the allowed values"


def from_validation_error(exc: ValidationError) -> FactoryError:
    """The first problem of a recipe that does not fit the schema, as our one-line error."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    label, info, table, deeper = _locate(tuple(first["loc"]))
    # A union (max_queue_size: "auto" or a number) reports one error per member: name the value, not a member.
    union = deeper and sum(1 for e in errors if _locate(tuple(e["loc"]))[0] == label) > 1
    if first["type"] == "extra_forbidden":
        fix = _generic_fix(first, label, table)
    elif first["type"] == "missing" and "." in label:
        own = _fix_of(info)
        fix = _generic_fix(first, label, table) + (f" ({own})" if own else "")
    else:
        fix = _fix_of(info) or _generic_fix(first, label, table)
    return field_error(label or "recipe", _problem(first, union), fix)
