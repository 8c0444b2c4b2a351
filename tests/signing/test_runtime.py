"""The backend's load-time check: standard library only, exact bytes, pinned key."""

from __future__ import annotations

import pytest

from model_factory.errors import FactoryError
from model_factory.signing import SignerConfig, sign_model_version
from model_factory.signing.runtime import IntegrityError, check_bytes, check_file, load_signed_digests, read_verified


@pytest.fixture
def signed(repo, keys):
    sign_model_version(repo / "encoder", 1, SignerConfig(keys["trusted"].private))
    return repo / "encoder"


def test_load_and_check(signed, keys):
    digests = load_signed_digests(signed, 1, public_key_pem=keys["trusted"].public.read_bytes())
    data = read_verified(signed, "1/model.onnx", digests)
    assert data == (signed / "1" / "model.onnx").read_bytes()
    check_file(signed, "config.pbtxt", digests)
    check_bytes("1/model.py", (signed / "1" / "model.py").read_bytes(), digests)
    assert issubclass(IntegrityError, FactoryError)  # one user-facing error type inside model-factory


def test_mismatches(signed, keys):
    digests = load_signed_digests(signed, 1)
    with pytest.raises(IntegrityError, match="does not match its signature"):
        check_bytes("1/model.onnx", b"other engine", digests)
    with pytest.raises(IntegrityError, match="is not covered by the model signature"):
        check_bytes("1/model.plan", b"", digests)
    (signed / "1" / "model.py").write_text("changed")
    with pytest.raises(IntegrityError, match="1/model.py does not match"):
        check_file(signed, "1/model.py", digests)
    with pytest.raises(IntegrityError, match="does not verify with the pinned public key"):
        load_signed_digests(signed, 1, public_key_pem=keys["other"].public.read_bytes())
    with pytest.raises(IntegrityError, match="missing or not a regular file"):
        load_signed_digests(signed, 2)


def test_inconsistent_bundle(signed):
    import base64
    import json
    sig = signed / "1.sig"
    doc = json.loads(sig.read_text())
    st = json.loads(base64.b64decode(doc["dsseEnvelope"]["payload"]))
    st["predicate"]["resources"][0]["digest"] = "0" * 64
    doc["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(st).encode()).decode()
    sig.write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match="is inconsistent"):
        load_signed_digests(signed, 1)


def test_runtime_works_as_a_copied_file_without_site_packages(signed, tmp_path):
    # The backend may carry a copy of runtime.py: no model_factory, no cryptography (python -I -S).
    import shutil
    import subprocess
    import sys

    import model_factory.signing.runtime as runtime
    shutil.copyfile(runtime.__file__, tmp_path / "mf_runtime.py")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import mf_runtime as r\n"
            f"d = r.load_signed_digests({str(signed)!r}, 1)\n"
            f"r.read_verified({str(signed)!r}, '1/model.onnx', d)\n"
            "try:\n    r.check_bytes('1/model.onnx', b'x', d)\nexcept r.IntegrityError as e:\n    print('caught', e)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('cryptography', 'model_factory'))))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "caught 1/model.onnx does not match its signature" in out.stdout
    assert out.stdout.strip().endswith("[]")
