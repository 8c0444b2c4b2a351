"""Parallel hashing gives exactly hashlib's digests, whatever the path taken."""

from __future__ import annotations

import hashlib
import os

import pytest

from model_factory.signing.digests import (CHUNK, HashTask, file_tasks, hash_task, hash_tasks, root_digest,
                                           sha256_file, shard_tasks)

SIZES = (0, 1, 2047, 2049, CHUNK - 1, CHUNK, CHUNK + 7, 3 * CHUNK + 12345)


@pytest.fixture
def files(tmp_path):
    out = {}
    for i, size in enumerate(SIZES):
        rel = f"d{i % 3}/f{i}.bin"
        p = tmp_path / rel
        p.parent.mkdir(exist_ok=True)
        data = os.urandom(size)
        p.write_bytes(data)
        out[rel] = hashlib.sha256(data).hexdigest()
    return tmp_path, out


@pytest.mark.parametrize("workers", [1, 2, 16])  # 16 > 8 files: read-ahead threads are used
@pytest.mark.parametrize("pipeline_threshold", [1, 1 << 40])  # always / never read ahead in a second thread
def test_hash_tasks_matches_hashlib(files, workers, pipeline_threshold):
    root, expected = files
    got = hash_tasks(file_tasks(root, expected), workers=workers, pipeline_threshold=pipeline_threshold)
    assert got == expected


def test_byte_ranges(tmp_path):
    data = os.urandom(5 * CHUNK + 3)
    p = tmp_path / "big.bin"
    p.write_bytes(data)
    for start, end in ((0, 0), (0, 10), (7, CHUNK + 9), (CHUNK, 5 * CHUNK + 3), (3, 5 * CHUNK + 3)):
        for threshold in (1, 1 << 40):
            assert hash_task(HashTask("x", p, start, end), threshold) == hashlib.sha256(data[start:end]).hexdigest()


def test_shard_tasks_follow_model_signing(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "empty").write_bytes(b"")
    tasks = shard_tasks(tmp_path, ["a", "empty"], 4)
    # model_signing: shards [0,4) [4,8) [8,10); an empty file has no shard.
    assert [t.name for t in tasks] == ["a:0:4", "a:4:8", "a:8:10"]
    assert hash_tasks(tasks)["a:8:10"] == hashlib.sha256(b"xx").hexdigest()
    with pytest.raises(ValueError):
        shard_tasks(tmp_path, ["a"], 0)


def test_hashing_does_not_follow_symlinks(tmp_path):
    (tmp_path / "real").write_bytes(b"data")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError):
        hash_task(HashTask("link", tmp_path / "link", 0, 4))


def test_duplicate_names_rejected(tmp_path):
    (tmp_path / "a").write_bytes(b"1")
    with pytest.raises(ValueError, match="unique"):
        hash_tasks([HashTask("x", tmp_path / "a", 0, 1), HashTask("x", tmp_path / "a", 0, 1)])


def test_root_digest_and_sha256_file(tmp_path):
    d1, d2 = hashlib.sha256(b"a").hexdigest(), hashlib.sha256(b"b").hexdigest()
    assert root_digest([d1, d2]) == hashlib.sha256(bytes.fromhex(d1) + bytes.fromhex(d2)).hexdigest()
    (tmp_path / "f").write_bytes(b"abc")
    assert sha256_file(tmp_path / "f") == hashlib.sha256(b"abc").hexdigest()


def test_a_file_that_changes_size_while_hashed_is_an_error(tmp_path):
    p = tmp_path / "growing.bin"
    p.write_bytes(b"a" * 100)
    (task,) = file_tasks(tmp_path, ["growing.bin"])
    with open(p, "ab") as f:
        f.write(b"appended after the size was taken")
    with pytest.raises(OSError, match="changed size while it was hashed"):
        hash_task(task)
    errors: dict[str, str] = {}
    assert hash_tasks([task], errors=errors) == {}
    assert errors == {"growing.bin": "the file changed size while it was hashed"}
