"""The data contract: written into every version, unchanged by a rebuild, and ``contract diff`` failing a
version whose tokenizer encodes the golden texts to other ids or whose limits were lowered."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from contract_versions import package_version as _package
from contract_versions import retrained_tokenizer as _retrained

from model_factory.build.data_contract import CONTRACT_FILE, GOLDEN_TEXTS, diff_contracts, load_contract
from model_factory.cli.main import main


def _diff(old: Path, new: Path):
    return CliRunner().invoke(main, ["contract", "diff", str(old), str(new)])


def test_a_rebuild_keeps_the_contract_and_a_retrained_tokenizer_breaks_it(minilm_recipe, minilm_export, tmp_path):
    v1 = _package(minilm_recipe, minilm_export, tmp_path / "a")
    contract = json.loads((v1 / CONTRACT_FILE).read_text())
    assert {i["name"]: i["meaning"] for i in contract["inputs"]}["text"] == "text"
    assert contract["limits"]["max_sequence_length"] == 128 and contract["limits"]["long_inputs"] == "refuse"
    assert [g["text"] for g in contract["tokenizer"]["golden"]] == list(GOLDEN_TEXTS)
    meta = json.loads((v1 / "metadata.json").read_text())
    assert CONTRACT_FILE in meta["files"]  # covered by the version's digests, hence its signature

    rebuild = _package(minilm_recipe, minilm_export, tmp_path / "b")
    done = _diff(v1, rebuild)
    assert done.exit_code == 0 and "no change" in done.output, done.output

    other = _package(minilm_recipe, minilm_export, tmp_path / "c",
                     tokenizer_dir=_retrained(minilm_export.tokenizer_dir, tmp_path / "tok"))
    done = _diff(v1, other)
    assert done.exit_code == 1, done.output
    assert "BREAKING  golden text 'A man is playing a guitar.' is tokenized differently" in done.output


def test_a_lowered_limit_breaks_and_a_raised_one_does_not(minilm_recipe, minilm_export, tmp_path):
    v1 = _package(minilm_recipe, minilm_export, tmp_path / "a")
    low = _package(minilm_recipe, minilm_export, tmp_path / "b", max_sequence_length=64, sequence_buckets=(64,))
    changes = diff_contracts(load_contract(v1), load_contract(low))
    assert [c.what for c in changes if c.breaking] == ["max_sequence_length lowered 128 -> 64"]
    assert _diff(low, v1).exit_code == 0  # raised: a client of the old one is still served


def test_inputs_gone_or_required_break() -> None:
    old = {"inputs": [{"name": "text", "dtype": "STRING", "dims": [1], "optional": True, "meaning": "text"}],
           "outputs": [{"name": "embedding", "dtype": "FP32", "dims": [384], "meaning": "tensor"}], "limits": {}}
    new = {"inputs": [{"name": "ids", "dtype": "INT64", "dims": [-1], "optional": False, "meaning": "tensor"}],
           "outputs": [{"name": "embedding", "dtype": "FP32", "dims": [768], "meaning": "tensor"}], "limits": {}}
    broken = {c.what for c in diff_contracts(old, new) if c.breaking}
    assert broken == {"input 'text' is gone", "input 'ids' is new and required",
                      "output 'embedding' changed dims [384] -> [768]"}
