"""Prompt-template recipes for the tests (tests/build/test_prompt.py, tests/integration/test_prompt_serving.py): a
recipe written beside its schema file, and a base entry as packaging reads it."""

from __future__ import annotations

import json
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"label": {"type": "string", "enum": ["bug", "question"]},
                                           "urgency": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "object", "properties": {
                                               "name": {"type": "string"}}}}},
          "required": ["label", "urgency"], "additionalProperties": False}


def fake_base(repo: Path, name: str = "base_lm") -> Path:
    """A text-generation entry as packaging reads it: its config's task, generation.json and tokenizer."""
    model_dir = repo / name
    (model_dir / "1" / "tokenizer").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\nparameters {{ key: "task" '
                                            'value { string_value: "text-generation" } }\n')
    (model_dir / "1" / "generation.json").write_text('{"chat_template": "x"}')
    (model_dir / "1" / "tokenizer" / "tokenizer.json").write_text("{}")
    return model_dir


def write_prompt_recipe(folder: Path, *, version: int = 1, system: str = "You triage support tickets.",
                        template: str = "Ticket: {{ ticket }}", schema: dict | None = SCHEMA,
                        generation: str = "max_tokens = 48\ntemperature = 0.0", base: str = "base_lm",
                        repo: str = "repo") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    schema_line = ""
    if schema is not None:
        (folder / f"schema-v{version}.json").write_text(json.dumps(schema))
        schema_line = f'schema_file = "schema-v{version}.json"'
    recipe = folder / f"triage-v{version}.toml"
    recipe.write_text(f"""[model]
name = "triage"
version = {version}
[base]
model = "{base}"
version = 1
[prompt]
system = {json.dumps(system)}
template = {json.dumps(template)}
{schema_line}
[generation]
{generation}
[repository]
path = "{repo}"
""")
    return recipe
