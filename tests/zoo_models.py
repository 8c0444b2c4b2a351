"""The Hugging Face half of the model zoo: tiny random-init models of every task, made in the test.

Each ``make_*`` saves a 2-layer model (hidden 32) with ``save_pretrained`` and MiniLM's tokenizer
files beside it (the vocabulary fits: 30522 ids), writes small calibration / held-out files of the
kind its task reads, and returns a :class:`ZooModel` with the recipe text. Nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
EXAMPLES = Path(__file__).resolve().parents[1] / "model_factory" / "examples"
NER_LABELS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")
SENTIMENT = ("negative", "positive")


@dataclass(frozen=True)
class ZooModel:
    """One zoo member: its folder, its task and the recipe that builds it."""

    name: str
    task: str
    folder: Path
    recipe: Path
    token_type_ids: bool


def _texts() -> list[str]:
    return [t for t in (EXAMPLES / "calibration.txt").read_text().splitlines() if t.strip()]


def _heldout() -> list[str]:
    return [t for t in (EXAMPLES / "heldout.txt").read_text().splitlines() if t.strip()]


def pairs(texts: list[str], per_query: int = 4) -> list[dict[str, str]]:
    """Query/passage pairs: each query (the first words of a text) against ``per_query`` passages."""
    out = []
    for i in range(0, len(texts) - per_query + 1, per_query):
        query = " ".join(texts[i].split()[:4])
        out += [{"query": query, "passage": texts[i + j]} for j in range(per_query)]
    return out


def _save(model, folder: Path, tokenizer_source: Path) -> None:
    model.eval().save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_source) / name, folder / name)


def _bert_config(**kw):
    from transformers import BertConfig

    return BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=128, **kw)


def _recipe(root: Path, name: str, task: str, folder: Path, calib: str, held: str, extra: str = "") -> Path:
    path = root / f"{name}.toml"
    path.write_text(f"""
precisions = ["fp32", "fp16", "int8"]

[model]
name = "{name}"
version = 1
task = "{task}"

[source]
kind = "huggingface"
path = "{folder}"

[shapes]
max_batch = 8
max_sequence_length = 64
sequence_buckets = [16, 64]

[quantization]
calibration_data = "{calib}"
heldout_data = "{held}"
max_calibration_samples = 32
max_heldout_samples = 24
{extra}
[repository]
path = "model_repository"
""")
    return path


def write_text_data(root: Path) -> tuple[str, str]:
    (root / "calib.txt").write_text("\n".join(_texts()[:40]) + "\n")
    (root / "heldout.txt").write_text("\n".join(_heldout()[:24]) + "\n")
    return "calib.txt", "heldout.txt"


def write_pair_data(root: Path) -> tuple[str, str]:
    for name, rows in (("calib_pairs.jsonl", pairs(_texts()[:40])), ("heldout_pairs.jsonl", pairs(_heldout()[:24]))):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return "calib_pairs.jsonl", "heldout_pairs.jsonl"


def make_encoder(root: Path, tokenizer_source: Path) -> ZooModel:
    """A BERT-style encoder (token_type_ids) served for embeddings."""
    import torch
    from transformers import BertModel

    torch.manual_seed(1)
    folder = root / "zoo-encoder"
    _save(BertModel(_bert_config()), folder, tokenizer_source)
    calib, held = write_text_data(root)
    return ZooModel("zoo-encoder", "embedding", folder,
                    _recipe(root, "zoo-encoder", "embedding", folder, calib, held, "min_accuracy = 0.95\n"), True)


def make_distilbert_classifier(root: Path, tokenizer_source: Path) -> ZooModel:
    """A DistilBERT sentiment classifier (no token_type_ids), logits and probabilities with labels."""
    import torch
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    torch.manual_seed(2)
    folder = root / "zoo-classifier"
    config = DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                              max_position_embeddings=128, num_labels=2,
                              id2label=dict(enumerate(SENTIMENT)), label2id={v: i for i, v in enumerate(SENTIMENT)})
    model = DistilBertForSequenceClassification(config)
    with torch.no_grad():  # a random head gives near-equal logits; a larger one separates the classes
        model.classifier.weight.mul_(20.0)
    _save(model, folder, tokenizer_source)
    calib, held = write_text_data(root)
    return ZooModel("zoo-classifier", "classification", folder,
                    _recipe(root, "zoo-classifier", "classification", folder, calib, held,
                            "min_accuracy = 0.8\n\n[classification]\nprobabilities = true\n"), False)


def make_token_classifier(root: Path, tokenizer_source: Path) -> ZooModel:
    """A BERT NER-style token classifier: per-token logits with labels."""
    import torch
    from transformers import BertForTokenClassification

    torch.manual_seed(3)
    folder = root / "zoo-tagger"
    config = _bert_config(num_labels=len(NER_LABELS), id2label=dict(enumerate(NER_LABELS)),
                          label2id={v: i for i, v in enumerate(NER_LABELS)})
    model = BertForTokenClassification(config)
    with torch.no_grad():
        model.classifier.weight.mul_(20.0)
    _save(model, folder, tokenizer_source)
    calib, held = write_text_data(root)
    return ZooModel("zoo-tagger", "token-classification", folder,
                    _recipe(root, "zoo-tagger", "token-classification", folder, calib, held, "min_accuracy = 0.8\n"),
                    True)


def make_reranker(root: Path, tokenizer_source: Path) -> ZooModel:
    """A BERT cross-encoder reranker: (query, passage) pairs in, one relevance score out."""
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(4)
    folder = root / "zoo-reranker"
    model = BertForSequenceClassification(_bert_config(num_labels=1))
    with torch.no_grad():
        model.classifier.weight.mul_(20.0)
    _save(model, folder, tokenizer_source)
    calib, held = write_pair_data(root)
    return ZooModel("zoo-reranker", "reranker", folder,
                    _recipe(root, "zoo-reranker", "reranker", folder, calib, held, "min_accuracy = 0.8\n"), True)


MAKERS = (make_encoder, make_distilbert_classifier, make_token_classifier, make_reranker)
