"""Tiny torch models for the TorchScript export and torch-engine tests (importable: tests/ is on sys.path).

``save_tiny_bert`` writes a small random BERT folder (save_pretrained) with MiniLM's tokenizer files;
``ENCODER_FACTORY`` is the source of a ``module:function`` factory for a token-id encoder shaped like
the Hugging Face export (input_ids, attention_mask -> last_hidden_state, embedding).
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def save_tiny_bert(folder: Path, tokenizer_source: Path, hidden: int = 32) -> Path:
    """A 2-layer random BERT (MiniLM's vocabulary) saved under ``folder``, with MiniLM's tokenizer files."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=2 * hidden, max_position_embeddings=128)
    BertModel(config).eval().save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_source) / name, Path(folder) / name)
    return Path(folder)


ENCODER_FACTORY = '''
import torch

VOCAB = 50


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, input_ids, attention_mask):
        hidden = torch.tanh(self.proj(self.embed(input_ids)))
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return hidden, (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


class Branchy(Encoder):
    def forward(self, input_ids, attention_mask):
        hidden, emb = super().forward(input_ids, attention_mask)
        if input_ids.shape[0] > 1:  # a Python branch on the batch size: a trace bakes it in
            emb = emb * 2
        return hidden, emb


def _example():
    ids = torch.randint(0, VOCAB, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def make():
    torch.manual_seed(0)
    return Encoder(), _example()


def make_branchy():
    torch.manual_seed(0)
    return Branchy(), _example()
'''


def encoder_recipe(factory: str, **export) -> dict:
    """A recipe (as a mapping) for :data:`ENCODER_FACTORY`'s ``factory`` with ``[export]`` ``export``."""
    return {"model": {"name": "enc", "task": "embedding"},
            "source": {"kind": "torch", "factory": factory},
            "inputs": [{"name": "input_ids", "dtype": "INT64", "dims": [-1]},
                       {"name": "attention_mask", "dtype": "INT64", "dims": [-1]}],
            "outputs": [{"name": "last_hidden_state", "dtype": "FP32", "dims": [-1, 8]},
                        {"name": "embedding", "dtype": "FP32", "dims": [8]}],
            "shapes": {"max_batch": 8, "max_sequence_length": 16, "sequence_buckets": [16]},
            "export": dict(export)}


def write_factory(folder: Path, monkeypatch) -> str:
    """Write :data:`ENCODER_FACTORY` as an importable module under ``folder``; return its module name."""
    name = f"tiny_encoder_{folder.name.replace('-', '_')}"
    (folder / f"{name}.py").write_text(ENCODER_FACTORY)
    monkeypatch.syspath_prepend(str(folder))
    return name
