"""Run by Python at start-up when this folder is on PYTHONPATH: installs the network guard.

Loaded by path so that nothing else from tests/deploy lands on the child's sys.path. It
replaces any other sitecustomize for that process (this one comes first on the path).
"""

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("network_guard", Path(__file__).resolve().parent.parent / "network_guard.py")
_guard = importlib.util.module_from_spec(_spec)
sys.modules["network_guard"] = _guard
_spec.loader.exec_module(_guard)
_guard.install()
