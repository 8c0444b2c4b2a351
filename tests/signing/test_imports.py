"""The signing package stays light: stdlib + cryptography; the backend's load-time check stdlib only."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("click", "numpy", "model_signing", "google", "sigstore", "sigstore_models", "OpenSSL", "rich", "torch",
         "onnx", "onnxruntime", "tensorrt", "requests")


def _top_level_modules(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json\n"
                          "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"],
                         capture_output=True, text=True, check=True, timeout=60)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_signing_package_imports_no_heavy_module():
    # ``import *`` resolves every re-export, so every module of the package is loaded.
    loaded = _top_level_modules("from model_factory.signing import *")
    assert {"cryptography", "model_factory"} <= loaded
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_the_load_time_check_needs_only_the_standard_library():
    loaded = _top_level_modules("import model_factory.backend.integrity")
    assert "cryptography" not in loaded
    # What is left besides the stdlib: our own package, and the hooks an editable install or
    # setuptools put into site-packages.
    third_party = {m for m in loaded - set(sys.stdlib_module_names) - {"model_factory", "__main__"}
                   if not m.startswith(("__editable__", "_distutils_hack"))}
    assert not third_party, third_party
