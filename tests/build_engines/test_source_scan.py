"""Scan before read: every source file classified, every pickle scanned by picklescan, before any library opens it.

The known-bad files are made here (a pickle calling os.system, eval reached through a reduce chain, a
pickle hidden in a zip-format torch file); each is refused with one line naming the file and what the
scanner found, and nothing is loaded: the payload would write a marker file, which never appears.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from pathlib import Path

import pytest

from model_factory.backend.contract import Files
from model_factory.build_engines.source_scan import classify, scan_files
from model_factory.errors import FactoryError
from model_factory.recipe import parse_recipe


class _System:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # unpickling calls os.system(...)
        return (os.system, (f"touch {self.marker}",))


def os_system_pickle(marker: Path) -> bytes:
    return pickle.dumps({"weight": _System(marker)}, protocol=2)


def eval_chain_pickle(marker: Path) -> bytes:
    """getattr(import_module('builtins'), 'eval')("open(marker, 'w')"): eval reached through a reduce chain."""
    code = f"open({str(marker)!r}, 'w')".encode()
    return (b"\x80\x02cbuiltins\ngetattr\n(cimportlib\nimport_module\n(X\x08\x00\x00\x00builtinstR"
            b"X\x04\x00\x00\x00evaltR(X" + len(code).to_bytes(4, "little") + code + b"tR.")


def zip_torch_file(payload: bytes) -> bytes:
    """A zip-format torch file (torch.save's layout) whose data.pkl is ``payload``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/version", "3\n")
        z.writestr("archive/data/0", b"\0" * 16)
    return buf.getvalue()


def hf_folder(folder: Path, weights_name: str, weights: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 8,
                                                      "vocab_size": 50, "max_position_embeddings": 64}))
    (folder / weights_name).write_bytes(weights)
    return folder


def hf_recipe(folder: Path, allow_pickle: bool = False):
    return parse_recipe({"model": {"name": "scanned"},
                         "source": {"kind": "huggingface", "path": str(folder), "allow_pickle": allow_pickle}},
                        folder.parent)


BAD = {"os.system": (lambda m: os_system_pickle(m), "pytorch_model.bin", "posix.system"),
       "eval chain": (lambda m: eval_chain_pickle(m), "model.ckpt", "builtins.getattr"),
       "zip-format .pt": (lambda m: zip_torch_file(os_system_pickle(m)), "pytorch_model.pt", "posix.system")}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("allow_pickle", [False, True])
def test_known_bad_pickles_are_refused_before_any_load(tmp_path: Path, case: str, allow_pickle: bool) -> None:
    from model_factory.build_engines.export import export_model

    make, name, finding = BAD[case]
    marker = tmp_path / "pwned"
    folder = hf_folder(tmp_path / "model", name, make(marker))
    with pytest.raises(FactoryError) as err:
        export_model(hf_recipe(folder, allow_pickle))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"source file {name} is a ") and finding in message
    assert "flags as dangerous" in message and "Fix:" in message
    assert not marker.exists(), "the payload ran: the file was loaded"
    assert not (tmp_path / "build").exists() or not any((tmp_path / "build").rglob("model.onnx"))


def test_a_plain_state_dict_is_refused_by_default_and_accepted_with_allow_pickle(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "pytorch_model.bin"
    torch.save(torch.nn.Linear(3, 4).state_dict(), path)
    refused = scan_files([path], tmp_path)
    assert refused.verdict == "refused" and refused.files[0].kind == "torch-zip"
    with pytest.raises(FactoryError, match=r"pytorch_model\.bin is a zip-format torch file .*it imports "
                                           r".*torch\._utils\._rebuild_tensor_v2.*Fix: convert it to safetensors"
                                           r".*allow_pickle = true"):
        refused.check()
    allowed = scan_files([path], tmp_path, allow_pickle=True).check()
    assert allowed.verdict == "pickle-allowed" and allowed.files[0].flagged == ()
    assert "collections.OrderedDict" in allowed.files[0].imports
    legacy = tmp_path / "legacy.pth"
    torch.save({"w": torch.zeros(2)}, legacy, _use_new_zipfile_serialization=False)
    assert scan_files([legacy], tmp_path, allow_pickle=True).check().files[0].kind == "pickle"


def test_files_are_classified_by_their_bytes_not_their_names(tmp_path: Path) -> None:
    import numpy as np

    (tmp_path / "weights.safetensors").write_bytes(os_system_pickle(tmp_path / "x"))  # a pickle in disguise
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "real.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    np.save(tmp_path / "plain.npy", np.ones(3))
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03\0\0\0" + b"\0" * 16)
    (tmp_path / "config.json").write_text("{}")
    np.savez(tmp_path / "calib.npz", x=np.ones((2, 3), np.float32))
    np.savez(tmp_path / "objects.npz", x=np.ones(2), o=np.array([None], dtype=object))
    kinds = {p.name: classify(p) for p in tmp_path.iterdir()}
    assert kinds == {"weights.safetensors": "pickle", "real.safetensors": "safetensors", "plain.npy": "numpy",
                     "objects.npy": "numpy-object", "model.gguf": "gguf", "config.json": "text",
                     "calib.npz": "numpy-zip", "objects.npz": "numpy-object-zip"}
    scan = scan_files(list(tmp_path.iterdir()), tmp_path, allow_pickle=True)
    verdicts = {f.path: f.verdict for f in scan.files}
    assert verdicts["weights.safetensors"] == "refused" and verdicts["real.safetensors"] == "ok"
    assert verdicts["objects.npy"] == "allowed" and verdicts["plain.npy"] == "ok"
    assert verdicts["objects.npz"] == "allowed" and verdicts["calib.npz"] == "ok"


def test_the_verdict_goes_into_the_export_report(tmp_path: Path, minilm_export) -> None:
    report = json.loads((minilm_export.onnx_path.parent / Files.EXPORT_REPORT).read_text())
    scan = report["source_scan"]
    assert scan["verdict"] == "clean" and scan["scanner"].startswith("picklescan")
    assert {"path": "model.safetensors", "kind": "safetensors", "verdict": "ok"} in scan["files"]
    assert minilm_export.source_scan == scan
