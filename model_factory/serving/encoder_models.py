"""The encoder models a server serves, as the OpenAI and TEI frontend sees them (``serve --openai-port``).

:func:`encoder_models` reads what the frontend needs from the repository ``serve`` verified: the task (the
version's ``metadata.json``), the tensors to send and read (``config.pbtxt``: ``text`` or ``query`` +
``passage``, ``embedding`` / ``score`` / ``logits``, ``max_batch_size``), the class labels (``labels.txt``),
whether the embeddings are unit length (the ``chunk_pooling`` parameter) and the sizes an embedding may be
truncated to (``metadata.json``'s ``embedding.matryoshka_dimensions``, from the recipe). The frontend calls the
model through Triton's KServe infer like any client: nothing here runs a model.

:class:`TokenCounter` counts a request's tokens for ``usage`` with the model's own tokenizer (the version's
``tokenizer/tokenizer.json``, read when the frontend starts), untruncated, as the backend tokenizes before its
long-input policy.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

EMBEDDING, CLASSIFICATION, RERANKER = "embedding", "classification", "reranker"
ENCODER_TASKS = (EMBEDDING, CLASSIFICATION, RERANKER)
# The output each task's answer is read from.
TASK_OUTPUT = {EMBEDDING: "embedding", CLASSIFICATION: "logits", RERANKER: "score"}


class TokenCounter:
    """The model's tokenizer, loaded on first use, counting tokens (special tokens included, untruncated)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._tok: Any = None
        self._lock = threading.Lock()

    def load(self) -> "TokenCounter":
        """Read the tokenizer now (at start: a later rollout may remove the version folder it came from)."""
        if self.path is not None:
            try:
                self._tokenizer()
            except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own exception type
                from model_factory.errors import FactoryError

                raise FactoryError(f"{self.path} cannot be read as a tokenizer ({exc}). Fix: package the model "
                                   "again with its tokenizer") from None
        return self

    def _tokenizer(self) -> Any:
        if self._tok is None:
            with self._lock:
                if self._tok is None:
                    from tokenizers import Tokenizer

                    tok = Tokenizer.from_file(str(self.path))
                    tok.no_padding()
                    tok.no_truncation()
                    self._tok = tok
        return self._tok

    def count(self, texts: Sequence[str | tuple[str, str]]) -> list[int]:
        """Tokens of each text (or (query, passage) pair); zeros when the model has no tokenizer."""
        if self.path is None or not texts:
            return [0] * len(texts)
        tok = self._tokenizer()
        # Without offsets where this tokenizers has it (0.20+): a fifth less CPU a text, the same ids.
        encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
        return [len(enc.ids) for enc in encode(list(texts))]


@dataclass(frozen=True)
class EncoderModel:
    """An embedding, classification or reranker model as the frontend calls it."""

    name: str
    task: str
    max_batch: int = 0  # Triton's max_batch_size: a request of more rows is sent as several infer calls
    text_input: bool = True  # the model takes text (`text`, or `query` + `passage`); else token ids only
    dimensions: int | None = None  # an embedding's size
    normalized: bool = False  # embeddings scaled to unit length
    matryoshka_dimensions: tuple[int, ...] = ()  # sizes it may be truncated to (and renormalized); () none
    labels: tuple[str, ...] = ()  # a classifier's labels, in index order
    takes_token_types: bool = False
    # Its texts' limit and default long-input mode (contract parameters max_sequence_length, long_inputs): where a
    # request's mode is refuse or truncate the frontend counts what was cut itself, without asking for
    # truncated_tokens (an output more costs Triton about 3 % of its CPU a one-text request); None: unknown.
    max_length: int | None = None
    long_inputs: str = "refuse"
    tokens: TokenCounter = field(default_factory=lambda: TokenCounter(None), compare=False, repr=False)

    @property
    def output(self) -> str:
        return TASK_OUTPUT[self.task]


def served_version(model_dir: Path, config: Any) -> Path | None:
    """The version folder Triton serves: the config's specific version (the highest), else the highest folder."""
    wanted = sorted(int(v) for v in config.version_policy.specific.versions)
    if wanted and (model_dir / str(wanted[-1])).is_dir():
        return model_dir / str(wanted[-1])
    versions = sorted((p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    return versions[-1] if versions else None


def _dims(config: Any, name: str) -> tuple[int, ...] | None:
    for out in config.output:
        if out.name == name:
            return tuple(int(d) for d in out.dims)
    return None


def _limits(params: Mapping[str, str]) -> dict[str, Any]:
    """``max_length`` and ``long_inputs`` read as the backend reads them (contract.parse_parameters); none if not."""
    from model_factory.backend.contract import ParameterError, parse_parameters

    try:
        parsed = parse_parameters(params)
    except (ParameterError, ValueError, TypeError):
        return {}
    return {"max_length": int(parsed.max_sequence_length), "long_inputs": str(parsed.long_inputs)}


def encoder_model(repository: Path, name: str) -> EncoderModel | None:
    """``name``'s model as the frontend calls it, or None when it is not an encoder the frontend serves."""
    from model_factory.backend.contract import Files
    from model_factory.build.repository import config_parameters, read_config

    model_dir = Path(repository) / name
    config = read_config(model_dir)
    version = served_version(model_dir, config)
    if version is None or not (version / Files.METADATA).is_file():
        return None
    try:
        metadata = json.loads((version / Files.METADATA).read_text())
    except ValueError:
        return None
    task = metadata.get("task")
    if task not in ENCODER_TASKS or _dims(config, TASK_OUTPUT[task]) is None:
        return None
    inputs = {i.name for i in config.input}
    params = config_parameters(config)
    dims = _dims(config, TASK_OUTPUT[task]) or ()
    tokenizer = version / Files.TOKENIZER_DIR / Files.TOKENIZER_JSON
    labels_file = model_dir / Files.LABELS
    labels = tuple(line for line in labels_file.read_text(encoding="utf-8").splitlines()) if labels_file.is_file() \
        else tuple(metadata.get("labels") or ())
    embedding = metadata.get("embedding") or {}
    return EncoderModel(
        name=name, task=task, max_batch=int(config.max_batch_size),
        text_input=("query" in inputs and "passage" in inputs) if task == RERANKER else "text" in inputs,
        dimensions=int(dims[-1]) if task == EMBEDDING and dims and dims[-1] > 0 else None,
        normalized=params.get("chunk_pooling") == "mean_normalized",
        matryoshka_dimensions=tuple(int(d) for d in embedding.get("matryoshka_dimensions") or ()),
        labels=labels, takes_token_types="token_type_ids" in inputs, **_limits(params),
        tokens=TokenCounter(tokenizer if tokenizer.is_file() else None).load())


def encoder_models(repository: Path, names: Sequence[str]) -> dict[str, EncoderModel]:
    """The embedding, classification and reranker models among ``names`` (the models ``serve`` serves)."""
    out = {}
    for name in names:
        model = encoder_model(repository, name)
        if model is not None:
            out[name] = model
    return out
