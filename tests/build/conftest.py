"""Generative builds shared by the tests of this folder: a zoo of tiny causal LMs, each built once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
EXAMPLES = Path(__file__).resolve().parents[2] / "model_factory" / "examples"
# Five families built FP32 (+ gemma's norm and qwen3's head_dim, phi3's fused projections and staged config).
ZOO = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gpt2")


def write_generative_recipe(folder: Path, model: Path, name: str, precisions=("fp32",), serve="fp32",
                            extra: str = "") -> Path:
    """A text-generation recipe for ``model`` in ``folder`` (held-out and calibration text: the examples')."""
    import shutil

    for f in ("calibration.txt", "heldout.txt"):
        shutil.copyfile(EXAMPLES / f, folder / f)
    quoted = ", ".join(f'"{p}"' for p in precisions)
    recipe = folder / f"{name}.toml"
    recipe.write_text(f"""precisions = [{quoted}]
[model]
name = "{name}"
task = "text-generation"
[source]
kind = "huggingface"
path = "{os.path.relpath(model, folder)}"
[shapes]
max_context = 256
[quantization]
calibration_data = "calibration.txt"
heldout_data = "heldout.txt"
min_token_agreement = 0.4
{extra}
[repository]
path = "repo"
serve = "{serve}"
keep_all_precisions = true
""")
    return recipe


@pytest.fixture(scope="session")
def generative_recipe():
    """:func:`write_generative_recipe`, for tests that write their own."""
    return write_generative_recipe


@pytest.fixture(scope="session")
def generative_keys(tmp_path_factory):
    from model_factory.signing import generate_keypair

    return generate_keypair(tmp_path_factory.mktemp("gen-keys") / "keys")


@pytest.fixture(scope="session")
def causal_lm_folders(tmp_path_factory):
    """family -> a tiny random-weight causal-LM folder (hidden 64, 2 layers, a trained BPE tokenizer)."""
    pytest.importorskip("onnxruntime_genai")
    from generative_models import make_causal_lm

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = tmp_path_factory.mktemp("causal-lms")
    return {f: make_causal_lm(f, root / f) for f in ZOO}


@pytest.fixture(scope="session")
def zoo_builds(tmp_path_factory, causal_lm_folders, generative_keys):
    """family -> (recipe, BuildResult): each family built FP32 and FP16 (serving FP32) and signed, in one
    repository."""
    from model_factory.build.pipeline import build
    from model_factory.recipe import load_recipe
    from model_factory.signing import SignerConfig

    root = tmp_path_factory.mktemp("zoo")
    out = {}
    for family, folder in causal_lm_folders.items():
        recipe = load_recipe(write_generative_recipe(root, folder, f"tiny-{family}", ("fp32", "fp16")))
        out[family] = (recipe, build(recipe, signer=SignerConfig(generative_keys.private_key)))
    return out


@pytest.fixture(scope="session")
def llama_quantized(tmp_path_factory, causal_lm_folders, generative_keys):
    """The tiny llama built FP32 + FP16 + INT8 (dynamic) + INT4 (awq), serving INT4, signed: (recipe, BuildResult,
    recipe path)."""
    from model_factory.build.pipeline import build
    from model_factory.recipe import load_recipe
    from model_factory.signing import SignerConfig

    root = tmp_path_factory.mktemp("llama-q")
    path = write_generative_recipe(root, causal_lm_folders["llama"], "tiny-llama-q", ("fp32", "fp16", "int8", "int4"), "int4",
                                   extra='int8_method = "dynamic"')
    recipe = load_recipe(path)
    return recipe, build(recipe, signer=SignerConfig(generative_keys.private_key)), path
