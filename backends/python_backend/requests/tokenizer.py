"""The model's own tokenizer, loaded from the version folder (``tokenizer/tokenizer.json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..contract import Files
from ..integrity import read_checked, verified_digests


def load_tokenizer(version_dir: Path, max_length: int, digests: Any = ...) -> Any:
    """A fast ``tokenizers.Tokenizer`` truncating to ``max_length`` and never padding.

    Padding is the executor's job: each group is padded only to its own longest
    item. The file is checked against the verified digests like the engine (``digests``: those given, e.g.
    by ``accept``; by default those ``serve`` handed to the server).
    """
    from tokenizers import Tokenizer  # imported here: only text models need it

    version_dir = Path(version_dir)
    relpath = f"{version_dir.name}/{Files.TOKENIZER_DIR}/{Files.TOKENIZER_JSON}"
    if not (version_dir.parent / relpath).is_file():
        raise FileNotFoundError(f"{relpath} is missing: the model was packaged without a fast tokenizer")
    if digests is ...:
        digests = verified_digests(version_dir.parent.name, version_dir.name)
    data = read_checked(version_dir.parent, relpath, digests)
    tok = Tokenizer.from_str(data.decode("utf-8"))
    tok.no_padding()
    tok.enable_truncation(max_length=max_length)
    return tok
