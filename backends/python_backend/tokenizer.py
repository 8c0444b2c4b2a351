"""The model's own tokenizer, loaded from the version folder (``tokenizer/tokenizer.json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(folder: Path, max_length: int) -> Any:
    """A fast ``tokenizers.Tokenizer`` truncating to ``max_length`` and never padding.

    Padding is the executor's job: each group is padded only to its own longest item.
    """
    from tokenizers import Tokenizer  # imported here: only text models need it

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the model was packaged without a fast tokenizer")
    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.enable_truncation(max_length=max_length)
    return tok
