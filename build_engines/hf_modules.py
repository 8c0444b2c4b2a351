"""The Hugging Face modules an export traces: the task's head wrapped so its outputs are what Triton serves.

An embedding model is wrapped to pool (mean or CLS) and normalize inside the graph; a classifier, tagger or
reranker to return its logits (and probabilities) under the names the recipe declares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model_factory.errors import FactoryError, require

SAMPLE_TEXTS = (
    "A man is playing a guitar on the street.",
    "The quick brown fox jumps over the lazy dog.",
    "Triton serves models.",
    "Offline builds must never reach the network, not even for telemetry or tokenizer files.",
)



def _encoder_inputs(input_ids: Any, attention_mask: Any, token_type_ids: Any = None) -> dict[str, Any]:
    """The keyword arguments of an HF encoder's forward(): ``token_type_ids`` only when the graph has it."""
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if token_type_ids is not None:
        kwargs["token_type_ids"] = token_type_ids
    return kwargs


def _embedding_module(model: Any, pooling: str, normalize: bool) -> Any:
    """Wrap an HF encoder so one graph returns ``last_hidden_state`` and a pooled ``embedding``."""
    torch = require("torch", "export")

    class EmbeddingModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids=None):  # noqa: ANN001
            kwargs = _encoder_inputs(input_ids, attention_mask, token_type_ids)
            hidden = self.model(**kwargs).last_hidden_state
            if pooling == "cls":
                emb = hidden[:, 0]
            else:
                mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
                emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            if normalize:
                emb = torch.nn.functional.normalize(emb, p=2.0, dim=1)
            return hidden, emb

    return EmbeddingModel().eval()


# The transformers class each task loads: the export keeps the head the task serves.
AUTO_CLASSES = {"classification": "AutoModelForSequenceClassification",
                "token-classification": "AutoModelForTokenClassification",
                "reranker": "AutoModelForSequenceClassification"}
# Query/passage pairs a reranker export is traced and checked on.
SAMPLE_PAIRS = ((SAMPLE_TEXTS[2], "Triton Inference Server serves models over HTTP and gRPC."),
                (SAMPLE_TEXTS[0], SAMPLE_TEXTS[1]),
                ("who serves models?", SAMPLE_TEXTS[3]),
                (SAMPLE_TEXTS[1], SAMPLE_TEXTS[2]))


def _head_module(model: Any, task: str, probabilities: bool) -> Any:
    """Wrap an HF model with a task head so the graph returns the task's outputs.

    ``classification`` and ``token-classification`` return ``logits`` (and softmax ``probabilities``
    over the labels), ``reranker`` one relevance ``score`` per pair (the head's single logit).
    """
    torch = require("torch", "export")

    class HeadModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids=None):  # noqa: ANN001
            kwargs = _encoder_inputs(input_ids, attention_mask, token_type_ids)
            logits = self.model(**kwargs).logits
            if task == "reranker":
                return logits[:, :1]
            if probabilities:
                return logits, torch.softmax(logits, dim=-1)
            return logits

    return HeadModel().eval()


def _load_hf(transformers: Any, src: Path, task: str) -> tuple[Any, Any]:
    """The tokenizer and the model with the task's head; a folder without that head is refused."""
    from model_factory.recipe import check_hf_task, read_hf_config

    check_hf_task(read_hf_config(src), task, src)
    cls_name = AUTO_CLASSES.get(task, "AutoModel")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(src), local_files_only=True)
        model, info = getattr(transformers, cls_name).from_pretrained(str(src), local_files_only=True,
                                                                      output_loading_info=True)
    except (OSError, ValueError) as exc:
        raise FactoryError(f"cannot load a Hugging Face model from {src}: {exc}. Fix: point source.path "
                           "at a folder with config.json, the weights and the tokenizer files") from exc
    missing = list(info.get("missing_keys") or [])
    if task in AUTO_CLASSES and missing:
        # transformers would initialise them at random: the served head would be noise.
        raise FactoryError(f"recipe field 'model.task': the weights in {src} lack {len(missing)} tensor(s) of the "
                           f"{task} head ({', '.join(missing[:3])}). Fix: save the trained model with its head (the "
                           "save_pretrained() of the model with the head writes its weights), or set "
                           "task = \"embedding\"")
    return tok, model.eval()


def _hf_samples(tok: Any, task: str, texts: Any, max_length: int) -> Any:
    if task == "reranker":
        pairs = list(texts)
        return tok([q for q, _ in pairs], [p for _, p in pairs], padding=True, truncation=True,
                   max_length=max_length, return_tensors="pt")
    return tok(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
