"""A version's data contract (``<version>/contract.json``, signed with the rest) and the diff between two.

What a client relies on, written down when a version is packaged: the inputs and outputs (name, dtype, dims,
whether optional, what they mean: text, token ids, mask, image, tensor), the limits (batch, sequence length,
what a longer text gets, the values an index input accepts), the tokenizer's digest and the ids it gives a
fixed set of golden texts. :func:`diff_contracts` names what changed between two versions and which changes
break a client: an input or output gone or retyped, a new required input, a limit lowered, a bound narrowed,
a golden text tokenized to other ids (a retrained tokenizer, seed 000's example of a broken contract); for a
prompt template, its system text, template fields, output-schema fields and defaults (``build/prompt_contract.py``). A
rebuild of the same model changes nothing; a new tokenizer file that encodes every golden text the same is
reported, not breaking. ``model-factory contract diff OLD NEW`` exits 1 on a breaking change, for CI.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from model_factory.backend.contract import TEXT_INPUT_NAMES, Files, parse_parameters
from model_factory.errors import FactoryError, require

CONTRACT_FILE = "contract.json"
CONTRACT_VERSION = 1
# Texts every version's tokenizer encodes into its contract: casing, accents, digits, punctuation, a rare word,
# CJK and an emoji, so a changed vocabulary or normalizer shows in at least one of them.
GOLDEN_TEXTS = (
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog!",
    "Café au lait costs 3.50 € in Zürich, naïvely.",
    "COVID-19 vaccines were approved in December 2020.",
    "antidisestablishmentarianism and pneumonoultramicroscopicsilicovolcanoconiosis",
    "東京は日本の首都です。",
    "emoji test 🙂 and tabs\tand  double  spaces",
    "e-mail: someone@example.com, url: https://example.com/a?b=c",
)
_TYPE_NAMES = {1: "BOOL", 2: "UINT8", 3: "UINT16", 4: "UINT32", 5: "UINT64", 6: "INT8", 7: "INT16", 8: "INT32",
               9: "INT64", 10: "FP16", 11: "FP32", 12: "FP64", 13: "STRING", 14: "BF16"}


def _meaning(name: str, dtype: str, dims: list[int]) -> str:
    if dtype == "STRING":
        return "text" if name in TEXT_INPUT_NAMES else "bytes"
    if name == "input_ids":
        return "token ids"
    if name == "attention_mask":
        return "attention mask"
    if name == "token_type_ids":
        return "segment ids"
    if dtype.startswith(("FP", "BF")) and len(dims) == 3:
        return "image"
    return "tensor"


def _tensors(entries: Any) -> list[dict[str, Any]]:
    out = []
    for t in entries:
        dtype = _TYPE_NAMES.get(int(t.data_type), str(t.data_type))
        dims = [int(d) for d in t.dims]
        out.append({"name": t.name, "dtype": dtype, "dims": dims, "optional": bool(getattr(t, "optional", False)),
                    "meaning": _meaning(t.name, dtype, dims)})
    return out


def _tokenizer(version_dir: Path) -> dict[str, Any] | None:
    path = version_dir / Files.TOKENIZER_DIR / Files.TOKENIZER_JSON
    if not path.is_file():
        return None
    from tokenizers import Tokenizer  # text models only

    tok = Tokenizer.from_file(str(path))
    tok.no_truncation()
    tok.no_padding()
    encodings = tok.encode_batch(list(GOLDEN_TEXTS))
    return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "golden": [{"text": t, "ids": list(e.ids)} for t, e in zip(GOLDEN_TEXTS, encodings)]}


def _parse_config(text: str) -> Any:
    from google.protobuf import text_format

    try:
        return text_format.Parse(text, require("tritonclient.grpc.model_config_pb2", "client").ModelConfig())
    except text_format.ParseError as exc:
        raise FactoryError(f"config.pbtxt does not parse: {exc}. Fix: regenerate it with model-factory package") from exc


def contract_for(config: Any, version_dir: Path) -> dict[str, Any]:
    """The contract of a version: from its parsed ``config.pbtxt`` (a ModelConfig) and its folder."""
    params = parse_parameters({k: v.string_value for k, v in config.parameters.items()})
    bounds = json.loads(params.input_bounds) if params.input_bounds else {}
    return {
        "contract_version": CONTRACT_VERSION,
        "model": config.name,
        "inputs": _tensors(config.input),
        "outputs": _tensors(config.output),
        "limits": {"max_batch": int(config.max_batch_size), "max_sequence_length": params.max_sequence_length,
                   "long_inputs": params.long_inputs, "input_bounds": {k: list(v) for k, v in sorted(bounds.items())}},
        "tokenizer": _tokenizer(Path(version_dir)),
        **_prompt(Path(version_dir)),
    }


def _prompt(version_dir: Path) -> dict[str, Any]:
    """A prompt template's section (``build/prompt.py``): absent from every other model's contract."""
    from model_factory.build.prompt_contract import prompt_contract

    section = prompt_contract(version_dir)
    return {"prompt": section} if section is not None else {}


def write_contract(config_text: str, version_dir: Path) -> Path:
    """Write ``contract.json`` into a version folder being packaged (before it is signed)."""
    path = Path(version_dir) / CONTRACT_FILE
    path.write_text(json.dumps(contract_for(_parse_config(config_text), version_dir), indent=2, sort_keys=True,
                               ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def load_contract(where: Path) -> dict[str, Any]:
    """A contract from ``contract.json``, a version folder holding one, or (older packages) its config."""
    where = Path(where)
    if where.is_file():
        return json.loads(where.read_text(encoding="utf-8"))
    if not where.is_dir():
        raise FactoryError(f"{where} is neither a version folder nor a contract.json. Fix: pass "
                           "<repository>/<model>/<version> (or its contract.json)")
    if (where / CONTRACT_FILE).is_file():
        return json.loads((where / CONTRACT_FILE).read_text(encoding="utf-8"))
    config = where.parent / Files.CONFIG
    if not config.is_file():
        raise FactoryError(f"{where} has neither {CONTRACT_FILE} nor a {Files.CONFIG} beside it. Fix: pass a "
                           "version folder of a model-factory repository")
    return contract_for(_parse_config(config.read_text()), where)  # packaged before contracts were written


@dataclass(frozen=True)
class Change:
    """One difference between two contracts."""

    what: str
    breaking: bool


def _by_name(items: list[dict]) -> dict[str, dict]:
    return {t["name"]: t for t in items}


def _dims_compatible(old: list[int], new: list[int]) -> bool:
    return len(old) == len(new) and all(n == -1 or n == o for o, n in zip(old, new))


def diff_contracts(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """What changed from ``old`` to ``new``, each change marked breaking or not."""
    changes: list[Change] = []
    for kind in ("inputs", "outputs"):
        before, after = _by_name(old.get(kind, [])), _by_name(new.get(kind, []))
        for name, t in before.items():
            if name not in after:
                changes.append(Change(f"{kind[:-1]} {name!r} is gone", True))
                continue
            n = after[name]
            if n["dtype"] != t["dtype"]:
                changes.append(Change(f"{kind[:-1]} {name!r} changed dtype {t['dtype']} -> {n['dtype']}", True))
            if not _dims_compatible(t["dims"], n["dims"]):
                changes.append(Change(f"{kind[:-1]} {name!r} changed dims {t['dims']} -> {n['dims']}", True))
            if kind == "inputs" and t.get("optional") and not n.get("optional"):
                changes.append(Change(f"input {name!r} is now required", True))
            if t.get("meaning") != n.get("meaning"):
                changes.append(Change(f"{kind[:-1]} {name!r} now means {n.get('meaning')!r} "
                                      f"(was {t.get('meaning')!r})", True))
        for name in after.keys() - before.keys():
            required = kind == "inputs" and not after[name].get("optional")
            changes.append(Change(f"{kind[:-1]} {name!r} is new" + (" and required" if required else ""), required))
    lo, ln = old.get("limits", {}), new.get("limits", {})
    for key in ("max_batch", "max_sequence_length"):
        if key in lo and key in ln and ln[key] != lo[key]:
            changes.append(Change(f"{key} {'lowered' if ln[key] < lo[key] else 'raised'} {lo[key]} -> {ln[key]}",
                                  ln[key] < lo[key]))
    if lo.get("long_inputs") != ln.get("long_inputs"):
        changes.append(Change(f"long_inputs {lo.get('long_inputs')} -> {ln.get('long_inputs')} (what a text over "
                              "the limit gets by default)", ln.get("long_inputs") == "refuse"))
    bo, bn = lo.get("input_bounds", {}), ln.get("input_bounds", {})
    for name, (low, high) in bo.items():
        if name in bn and (bn[name][0] > low or bn[name][1] < high):
            changes.append(Change(f"input {name!r} accepts {bn[name]} (was [{low}, {high}]): narrowed", True))
    for name in bn.keys() - bo.keys():
        changes.append(Change(f"input {name!r} is now bounded to {bn[name]}", True))
    to, tn = old.get("tokenizer"), new.get("tokenizer")
    if to and not tn:
        changes.append(Change("the tokenizer is gone (text is no longer accepted)", True))
    elif tn and to:
        golden_old = {g["text"]: g["ids"] for g in to.get("golden", [])}
        for g in tn.get("golden", []):
            if g["text"] in golden_old and g["ids"] != golden_old[g["text"]]:
                changes.append(Change(f"golden text {g['text']!r} is tokenized differently "
                                      f"({len(golden_old[g['text']])} -> {len(g['ids'])} ids): the tokenizer was "
                                      "retrained or changed", True))
        if to.get("sha256") != tn.get("sha256") and not any(c.what.startswith("golden") for c in changes):
            changes.append(Change("tokenizer.json changed, every golden text tokenized the same", False))
    from model_factory.build.prompt_contract import diff_prompts

    changes += [Change(f"prompt: {what}", breaking) for what, breaking in diff_prompts(old.get("prompt"),
                                                                                        new.get("prompt"))]
    return changes
