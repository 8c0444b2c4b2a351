"""The load-time check that runs (the backend's ``integrity``) against digests from a full verification.

``serve`` verifies with the policy (``signed_digests``), hands the digests to the backend, and the backend
reads each file once, hashes those bytes and uses them: a file changed after verification is refused.
"""

from __future__ import annotations

import json

import pytest

from model_factory.signing import SignerConfig, load_policy, sign_model_version, signed_digests


@pytest.fixture
def signed(repo, keys):
    sign_model_version(repo / "encoder", 1, SignerConfig(keys["trusted"].private))
    return repo / "encoder"


def test_verified_bytes_are_read_once_and_changed_ones_refused(signed, key_policy, tmp_path):
    from model_factory.backend.integrity import IntegrityError, copy_checked, read_checked

    digests = signed_digests(signed, 1, load_policy(key_policy()))
    assert read_checked(signed, "1/model.onnx", digests) == (signed / "1" / "model.onnx").read_bytes()
    copy_checked(signed, "1/model.onnx", digests, tmp_path / "copy.onnx")
    with pytest.raises(IntegrityError, match="is not covered by the verified signature"):
        read_checked(signed, "1/model.plan", digests)
    (signed / "1" / "model.onnx").write_bytes(b"other engine")
    with pytest.raises(IntegrityError, match="1/model.onnx changed after verification"):
        read_checked(signed, "1/model.onnx", digests)
    with pytest.raises(IntegrityError, match="changed after verification"):
        copy_checked(signed, "1/model.onnx", digests, tmp_path / "again.onnx")
    assert not (tmp_path / "again.onnx").exists()  # nothing unverified is left to load


def test_the_table_serve_writes_is_what_the_backend_reads(signed, key_policy, tmp_path, monkeypatch):
    from model_factory.backend.integrity import ENV, IntegrityError, verified_digests

    monkeypatch.delenv(ENV, raising=False)
    assert verified_digests("encoder", "1") is None  # a server started without verification
    table = tmp_path / "verified.json"
    table.write_text(json.dumps({"encoder": {"1": signed_digests(signed, 1, load_policy(key_policy()))}}))
    monkeypatch.setenv(ENV, str(table))
    assert "1/model.onnx" in verified_digests("encoder", "1")
    with pytest.raises(IntegrityError, match="was not verified before the server started"):
        verified_digests("encoder", "2")


def test_integrity_works_as_a_copied_file_without_site_packages(signed, key_policy, tmp_path):
    # The backend is copied into each version: integrity.py needs the standard library only (python -I -S).
    import shutil
    import subprocess
    import sys

    import model_factory.backend.integrity as integrity

    digests = signed_digests(signed, 1, load_policy(key_policy()))
    shutil.copyfile(integrity.__file__, tmp_path / "mf_integrity.py")
    (tmp_path / "digests.json").write_text(json.dumps(digests))
    code = (f"import sys, json; sys.path.insert(0, {str(tmp_path)!r}); import mf_integrity as r\n"
            f"d = json.load(open({str(tmp_path / 'digests.json')!r}))\n"
            f"r.read_checked({str(signed)!r}, '1/model.onnx', d)\n"
            "d['1/model.onnx'] = '0' * 64\n"
            f"try:\n    r.read_checked({str(signed)!r}, '1/model.onnx', d)\n"
            "except r.IntegrityError as e:\n    print('caught', e)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('cryptography', 'model_factory', 'numpy'))))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "caught 1/model.onnx changed after verification" in out.stdout
    assert out.stdout.strip().endswith("[]")


def test_a_sparse_data_file_is_copied_with_its_holes_and_the_same_digest(tmp_path):
    # A weight file whose zero runs the filesystem stores as holes (a table with unused rows): the private
    # copy the backend loads from keeps them as holes (no disk for them), and hashes them as the zeros they read as.
    import hashlib

    from model_factory.backend.integrity import IntegrityError, copy_checked

    model_dir = tmp_path / "m"
    (model_dir / "1").mkdir(parents=True)
    src = model_dir / "1" / "model.onnx.data"
    size, head, tail = 256 << 20, b"\x01" * 4096, b"\x02" * 3000
    with src.open("wb") as f:
        f.write(head)
        f.seek(100 << 20)
        f.write(b"\x03" * 5000)
        f.seek(size - len(tail))
        f.write(tail)
    expected = src.read_bytes()
    digests = {"1/model.onnx.data": hashlib.sha256(expected).hexdigest()}
    copy = tmp_path / "copy.data"
    copy_checked(model_dir, "1/model.onnx.data", digests, copy)
    assert copy.read_bytes() == expected
    if src.stat().st_blocks * 512 < size // 4:  # this filesystem keeps holes: so must the copy
        assert copy.stat().st_blocks * 512 < size // 4, copy.stat().st_blocks
    # A file that ends in a hole keeps its length.
    with src.open("r+b") as f:
        f.truncate(size + (8 << 20))
    digests = {"1/model.onnx.data": hashlib.sha256(src.read_bytes()).hexdigest()}
    copy_checked(model_dir, "1/model.onnx.data", digests, copy)
    assert copy.stat().st_size == size + (8 << 20) and copy.read_bytes() == src.read_bytes()
    # A byte written into a hole after verification is caught like any other change.
    with src.open("r+b") as f:
        f.seek(50 << 20)
        f.write(b"\x04")
    with pytest.raises(IntegrityError, match="changed after verification"):
        copy_checked(model_dir, "1/model.onnx.data", digests, tmp_path / "again.data")
    assert not (tmp_path / "again.data").exists()
