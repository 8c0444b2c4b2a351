"""A prompt template's Triton model (``task = "prompt"``): it answers each request with its signed definition.

A prompt template (docs/generation.md, "Prompt templates") is packaged as a model of its own: its version folder
holds ``prompt.json`` (system text, the template over the user's fields, the output schema, generation defaults, the
base model it runs on), signed with the rest. At load its bytes are read once and checked against the digests
``serve`` verified (``integrity``): a ``prompt.json`` changed after verification is refused, and the version does
not load. Each request is then answered with those bytes (output ``prompt``), by whichever version Triton routes it
to, so a rollout's switch moves the OpenAI front to the new definition for every request sent after it, and a
request already answered by the previous one finishes on the base model as it began. Rendering the template and
generating are the front's and the base model's (``model_factory/serving/openai_prompts.py``): nothing here but
the standard library and numpy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .contract import PROMPT_OUTPUT, Files
from .integrity import read_checked, verified_digests


def read_definition(version_dir: Path, model: str, version: str) -> bytes:
    """``prompt.json`` of a version as verified (IntegrityError when it changed or was never verified), checked
    to be a JSON object with a template."""
    data = read_checked(Path(version_dir).parent, f"{version}/{Files.PROMPT}", verified_digests(model, version))
    definition = json.loads(data.decode("utf-8"))
    if not isinstance(definition, dict) or not isinstance(definition.get("template"), str):
        raise ValueError(f"{Files.PROMPT} of {model} version {version} holds no template")
    return data


class PromptDefinition:
    """One instance of a prompt model: its definition read at load, the same bytes answered to every request."""

    def __init__(self, pb_utils: Any, args: dict, settings: Any) -> None:
        self.pb_utils = pb_utils
        version = str(args["model_version"])
        self.data = read_definition(Path(args["model_repository"]) / version, settings.model_name, version)
        pb_utils.Logger.log_info(f"model-factory backend: {settings.model_name} serves prompt version {version} "
                                 f"({len(self.data)} bytes, verified)")

    def execute(self, requests: list) -> list:
        out = np.array([self.data], dtype=np.object_)
        return [self.pb_utils.InferenceResponse(output_tensors=[self.pb_utils.Tensor(PROMPT_OUTPUT, out)])
                for _ in requests]

    def finalize(self) -> None:
        return None
