"""A prompt template's recipe: system text, a template over the user's fields, an output schema, generation defaults.

A small TOML file of its own, on a base model the repository serves (a text-generation entry, named by its
repository name and the version whose files it was written for)::

    [model]
    name = "triage"              # the name clients call on the OpenAI API
    version = 1

    [base]
    model = "tiny_llm"           # a text-generation model in the same repository
    version = 1                  # the version packaging pins (the digests of its chat template and tokenizer)

    [prompt]
    system = "You triage support tickets."
    template = "Ticket: {{ ticket }}\\nCustomer tier: {{ tier }}"
    schema_file = "triage.schema.json"   # or an inline [prompt.schema] table; none: free text

    [generation]                 # defaults a request's own values override
    max_tokens = 64
    temperature = 0.0

    [repository]
    path = "model_repository"

The template is Jinja2 in its sandbox (``ImmutableSandboxedEnvironment``, as Hugging Face chat templates are run:
no attribute of a Python object outside the safe set, no mutation, nothing read from disk or the network), with
``StrictUndefined``: a field the request does not fill is an error naming it, never an empty string. Its fields are
the template's own undeclared variables (``jinja2.meta``). :func:`parse_prompt_recipe` returns the frozen
:class:`PromptRecipe`; its :meth:`~PromptRecipe.definition` is the ``prompt.json`` packaging signs
(``model_factory/build/prompt.py``) and the OpenAI front serves (``model_factory/serving/openai_prompts.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from model_factory.errors import FactoryError
from model_factory.recipe.errors import field_error
from model_factory.recipe.schema import INT32_MAX, NAME_PATTERN, POSITIVE_FIX, Fix, Positive

PROMPT_TASK = "prompt"
DEFINITION_VERSION = 1  # prompt.json's format
# The generation defaults a prompt may set: the OpenAI request fields of the same names (a request's own win).
DEFAULT_KEYS = ("max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty")


class _Table(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class PromptModelTable(_Table):
    name: Annotated[str, Field(pattern=NAME_PATTERN), Fix("use letters, digits, '_', '-' and '.'")] = Field(
        description="The name clients call (OpenAI `model`): the prompt's folder in the repository.")
    version: Positive = Field(1, description="The version folder written.")
    task: Annotated[str, Field(pattern="^prompt$"), Fix('write task = "prompt" or leave it out')] = Field(
        PROMPT_TASK, description='Always "prompt".')


class BaseTable(_Table):
    model: Annotated[str, Field(pattern=NAME_PATTERN), Fix("name a text-generation model of the repository")] = Field(
        description="The text-generation model the prompt runs on, by its repository name.")
    version: Positive = Field(description="The base version the prompt was written for: packaging records the "
                              "digests of its generation.json (chat template) and tokenizer.")


class PromptTable(_Table):
    system: Annotated[str, Fix("give the system text as a string")] = Field(
        "", description="The system message (empty: none).")
    template: Annotated[str, Field(min_length=1), Fix("give a Jinja2 template over the user's fields, e.g. "
                                                      "template = \"Ticket: {{ ticket }}\"")] = Field(
        description="The user message: Jinja2 (sandboxed, strict) over the request's fields.")
    schema_: Annotated[Optional[dict[str, Any]], Fix("write the output JSON Schema as a table")] = Field(
        None, alias="schema", description="The output's JSON Schema (inline), enforced by structured outputs.")
    schema_file: Annotated[Optional[str], Fix("give the path of a .json file holding the schema")] = Field(
        None, description="The output's JSON Schema in a .json file, relative to the recipe.")


Number = Union[int, float]


class PromptGenerationTable(_Table):
    """[generation]: the defaults of the OpenAI request fields of the same names; a request's own values win."""

    max_tokens: Annotated[Optional[int], Field(gt=0, le=INT32_MAX), POSITIVE_FIX] = None
    temperature: Annotated[Optional[Number], Field(ge=0, le=2), Fix("give a number in [0, 2]")] = None
    top_p: Annotated[Optional[Number], Field(gt=0, le=1), Fix("give a number in (0, 1]")] = None
    seed: Annotated[Optional[int], Fix("give a whole number")] = None
    stop: Annotated[Optional[Union[str, list[str]]], Fix("give a string or a list of strings")] = None
    presence_penalty: Annotated[Optional[Number], Field(ge=-2, le=2), Fix("give a number in [-2, 2]")] = None
    frequency_penalty: Annotated[Optional[Number], Field(ge=-2, le=2), Fix("give a number in [-2, 2]")] = None


class PromptRepositoryTable(_Table):
    """[repository]: the repository the prompt is packaged into (its base's)."""

    path: Annotated[str, Fix("give a path as a string")] = Field("model_repository", description="The repository.")


class PromptRecipeFile(_Table):
    """A prompt template's recipe."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, title="model-factory prompt recipe")

    model: PromptModelTable
    base: BaseTable
    prompt: PromptTable
    generation: PromptGenerationTable = PromptGenerationTable()
    repository: PromptRepositoryTable = PromptRepositoryTable()


@dataclass(frozen=True)
class PromptRecipe:
    """One prompt template, checked: what ``prompt.json`` says, and where it is packaged."""

    name: str
    version: int
    base_model: str
    base_version: int
    system: str
    template: str
    fields: tuple[str, ...]
    schema: Mapping[str, Any] | None
    defaults: Mapping[str, Any]
    repository: Path
    recipe_path: Path | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def definition(self, base_digests: Mapping[str, str]) -> dict[str, Any]:
        """``prompt.json``: the prompt with the base pinned by ``base_digests`` (version-folder path -> sha256)."""
        return {"definition_version": DEFINITION_VERSION, "name": self.name, "version": self.version,
                "base": {"model": self.base_model, "version": self.base_version, "digests": dict(base_digests)},
                "system": self.system, "template": self.template, "fields": list(self.fields),
                "schema": self.schema, "defaults": dict(self.defaults)}


def prompt_recipe_json_schema() -> dict[str, Any]:
    """The prompt recipe's JSON Schema, for editors (``model-factory schema --prompt``), draft-07 as the recipe's."""
    from model_factory.recipe.schema import _TomlJsonSchema

    body = PromptRecipeFile.model_json_schema(schema_generator=_TomlJsonSchema)
    return {"$schema": "http://json-schema.org/draft-07/schema#", **body}


def is_prompt_recipe(data: Mapping[str, Any]) -> bool:
    """Whether a recipe mapping is a prompt template's (it has a ``[prompt]`` table)."""
    return isinstance(data.get("prompt"), Mapping)


def _jinja() -> Any:
    try:
        from jinja2 import StrictUndefined
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise FactoryError("prompt templates need jinja2. Fix: pip install 'model-factory[serve]'") from exc
    return ImmutableSandboxedEnvironment(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=True)


def template_fields(template: str, where: str = "prompt.template") -> tuple[str, ...]:
    """The fields a template reads (its undeclared variables, sorted); a syntax error names its line."""
    from jinja2 import TemplateSyntaxError, meta

    try:
        return tuple(sorted(meta.find_undeclared_variables(_jinja().parse(template))))
    except TemplateSyntaxError as exc:
        raise field_error(where, f"the template does not parse (line {exc.lineno}: {exc.message})",
                          "write Jinja2: {{ field }} for a field, {% if field %}...{% endif %}") from None


class MissingField(Exception):
    """A template read a field the request did not fill (``name``)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def render_template(template: str, values: Mapping[str, Any]) -> str:
    """The template filled with ``values`` in Jinja2's sandbox (strict: :class:`MissingField` for a field unset);
    any other template error is a ValueError with Jinja2's message."""
    from jinja2 import TemplateError, UndefinedError

    try:
        return _jinja().from_string(template).render(**values)
    except UndefinedError as exc:
        text = str(exc)  # "'ticket' is undefined"
        name = text.split("'")[1] if text.count("'") >= 2 else text
        raise MissingField(name, text) from None
    except TemplateError as exc:
        raise ValueError(str(exc)) from None


def schema_problem(schema: Any) -> str | None:
    """Why llguidance (the grammar engine that enforces it: docs/generation.md) cannot compile ``schema`` as the
    backend does, or None: it compiles, or there is no schema, or llguidance is not installed here (the extra
    ``serve``; the server checks it again at acceptance and at each request)."""
    if schema is None:
        return None
    try:
        import llguidance
    except ImportError:
        return None
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        error = llguidance.LLMatcher.validate_grammar(grammar)  # "" when it compiles
    except ValueError as exc:
        return str(exc)
    return error or None


def _schema(doc: PromptTable, base_dir: Path) -> dict[str, Any] | None:
    if doc.schema_ is not None and doc.schema_file is not None:
        raise field_error("prompt.schema_file", "both schema and schema_file are given", "keep one of them")
    schema: Any = doc.schema_
    if doc.schema_file is not None:
        path = Path(doc.schema_file).expanduser()
        path = path if path.is_absolute() else base_dir / path
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise field_error("prompt.schema_file", f"{path} cannot be read ({exc.strerror})",
                              "point it at a .json file beside the recipe") from None
        except ValueError as exc:
            raise field_error("prompt.schema_file", f"{path} is not JSON ({exc})", "fix the file's JSON") from None
    if schema is None:
        return None
    if not isinstance(schema, dict) or not isinstance(schema.get("type", "object"), (str, list)):
        raise field_error("prompt.schema", "is not a JSON Schema object", 'give an object such as {"type": "object", '
                          '"properties": {...}}')
    problem = schema_problem(schema)
    if problem is not None:
        raise field_error("prompt.schema", f"the grammar engine cannot enforce it: {problem}",
                          "use the JSON Schema keywords docs/generation.md lists as enforced")
    return schema


def _refusal(err: Mapping[str, Any]) -> FactoryError:
    """The first schema error as the recipe's one-line refusal: the field, the problem, the field's own fix."""
    model: Any = PromptRecipeFile
    info, table = None, PromptRecipeFile
    for part in err["loc"]:
        fields = getattr(model, "model_fields", None)
        if not isinstance(part, str) or fields is None:
            break
        table, info = model, fields.get(part) or next((f for f in fields.values() if f.alias == part), None)
        model = getattr(info, "annotation", None) if info is not None else None
        model = model if isinstance(model, type) and issubclass(model, BaseModel) else None
    where = ".".join(str(p) for p in err["loc"] if isinstance(p, str)) or "recipe"
    if err["type"] == "extra_forbidden":
        return field_error(where, "unknown key", "remove it or use one of: " + ", ".join(
            sorted(f.alias or n for n, f in table.model_fields.items())))
    fixes = [m.text for m in (info.metadata if info is not None else ()) if isinstance(m, Fix)]
    problem = "missing" if err["type"] == "missing" else f"{err['msg'].lower()} (got {err.get('input')!r:.40})"
    return field_error(where, problem, fixes[-1] if fixes else "see docs/models.md, \"A prompt template\"")


def parse_prompt_recipe(data: Mapping[str, Any], base_dir: Path, recipe_path: Path | None = None) -> PromptRecipe:
    """Check a prompt recipe mapping (as read from TOML); a wrong one is a FactoryError naming the field."""
    try:
        doc = PromptRecipeFile.model_validate(data)
    except ValidationError as exc:
        raise _refusal(exc.errors(include_url=False)[0]) from None
    fields = template_fields(doc.prompt.template)
    if template_fields(doc.prompt.system, "prompt.system"):
        raise field_error("prompt.system", f"reads fields {list(template_fields(doc.prompt.system))}",
                          "keep fields in the template; the system text is the same for every request")
    defaults = {k: v for k, v in doc.generation.model_dump().items() if v is not None}
    repo = Path(doc.repository.path).expanduser()
    return PromptRecipe(
        name=doc.model.name, version=doc.model.version, base_model=doc.base.model, base_version=doc.base.version,
        system=doc.prompt.system, template=doc.prompt.template, fields=fields,
        schema=_schema(doc.prompt, base_dir), defaults=defaults,
        repository=repo if repo.is_absolute() else base_dir / repo, recipe_path=recipe_path, raw=dict(data))


def read_recipe_data(path: Path | str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A recipe file's mapping, ``overrides`` (``section.key`` -> value, as the CLI's -r) applied."""
    from model_factory.fileio import read_toml

    data = read_toml(Path(path), "recipe", "pass the path of a .toml recipe (see examples/minilm.toml)")
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.rpartition(".")
        target = data.setdefault(section, {}) if section else data
        if isinstance(target, dict):
            target[key] = value
    return data


def load_prompt_recipe(path: Path | str, overrides: Mapping[str, Any] | None = None) -> PromptRecipe:
    """A prompt recipe from its TOML file."""
    path = Path(path)
    return parse_prompt_recipe(read_recipe_data(path, overrides), path.resolve().parent, path.resolve())
