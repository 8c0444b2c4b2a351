"""Writers killed at random instants leave the previous repository intact and verifying; two writers of
one model never interleave (a lock refuses the second at once)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from model_factory.errors import FactoryError

# Repackages version 1 with new bytes (signed while staged, as `build` does), then re-signs the whole
# repository (as `sign` does), over and over until killed. Says "ready" once its imports are done.
WRITER = r'''
import os, sys
from pathlib import Path
from model_factory.recipe import load_recipe
from model_factory.build.repository import package_model
from model_factory.build.pipeline import provenance_for
from model_factory.signing import SignerConfig, sign_model_version, sign_repository
example, repo, key, work = (Path(a) for a in sys.argv[1:5])
recipe = load_recipe(example, {"repository.path": str(repo), "precisions": ["fp32"]})
signer = SignerConfig(private_key=key, password=None)
prov = provenance_for(recipe, {"source_digest": "0" * 64}, accuracy=None)
print("ready", flush=True)
i = 0
while True:
    i += 1
    onnx = work / f"model-{os.getpid()}-{i}.onnx"
    onnx.write_bytes(os.urandom(8 << 20))
    package_model(recipe, {"model.onnx": onnx}, parameters={"cost_model": "0.002,1e-6,1e-9"},
                  sign=lambda staged: sign_model_version(staged, 1, signer, provenance=prov))
    onnx.unlink()
    sign_repository(repo, signer, prov)
'''


@pytest.fixture
def signed_repo(tmp_path: Path, minilm_recipe):
    from model_factory.demo import write_key_policy
    from model_factory.build.pipeline import provenance_for
    from model_factory.build.repository import package_model
    from model_factory.signing import SignerConfig, generate_keypair, sign_model_version

    repo = tmp_path / "repo"
    recipe = replace(minilm_recipe, repository=replace(minilm_recipe.repository, path=repo))
    keys = generate_keypair(tmp_path / "keys")
    signer = SignerConfig(private_key=keys.private_key, password=None)
    onnx = tmp_path / "first.onnx"
    onnx.write_bytes(os.urandom(8 << 20))
    prov = provenance_for(recipe, {"source_digest": "0" * 64}, accuracy=None)
    package_model(recipe, {"model.onnx": onnx}, parameters={"cost_model": "0.002,1e-6,1e-9"},
                  sign=lambda staged: sign_model_version(staged, 1, signer, provenance=prov))
    return recipe, keys.private_key, write_key_policy(tmp_path / "policy.toml", [keys.public_key])


def _verified(repo: Path, policy: Path) -> list[tuple[str, bool, tuple[str, ...]]]:
    from model_factory.signing import load_policy, verify_repository

    return [(r.model, r.ok, r.reasons) for r in verify_repository(repo, load_policy(policy))]


@pytest.mark.slow
def test_package_and_sign_killed_at_random_instants_leave_a_verifying_repository(signed_repo, tmp_path: Path) -> None:
    from tests.conftest import EXAMPLE

    recipe, key, policy = signed_repo
    repo = recipe.repository.path
    work = tmp_path / "work"
    work.mkdir()
    rng = random.Random(12)
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(EXAMPLE), str(repo), str(key), str(work)],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 1.5))  # one package + sign round takes about a second here
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        # Whatever instant it died at: exactly the model, signed and verifying, at its place.
        assert _verified(repo, policy) == [("minilm", True, ())]
    # The next writer clears what a killed one left (hidden staging folders), under the lock.
    onnx = work / "last.onnx"
    onnx.write_bytes(b"final bytes")
    from model_factory.build.repository import package_model

    package_model(recipe, {"model.onnx": onnx})
    assert not [p for p in repo.iterdir() if p.is_dir() and p.name.startswith(".")]


def test_a_second_writer_of_one_model_is_refused_at_once(signed_repo, tmp_path: Path) -> None:
    from model_factory.build.repository import package_model
    from model_factory.signing import SignerConfig, sign_model_version

    recipe, key, policy = signed_repo
    model_dir = recipe.repository.path / recipe.name
    onnx = tmp_path / "other.onnx"
    onnx.write_bytes(b"other bytes")
    before = (model_dir / "1" / "model.onnx").read_bytes()
    # Another process holds the model's lock (as a running package or sign would).
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time; from model_factory.locking import exclusive\n"
                               "with exclusive(__import__('pathlib').Path(sys.argv[1]), 'x'):\n"
                               "    print('held', flush=True); time.sleep(60)", str(model_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FactoryError, match=rf"packaging or signing of minilm is already running \(pid {holder.pid}"):
            package_model(recipe, {"model.onnx": onnx})
        with pytest.raises(FactoryError, match="already running.*Fix: wait"):
            sign_model_version(model_dir, 1, SignerConfig(private_key=key, password=None))
    finally:
        holder.kill()
        holder.wait()
    assert (model_dir / "1" / "model.onnx").read_bytes() == before
    assert _verified(recipe.repository.path, policy) == [("minilm", True, ())]
    # Released by the kernel when its holder died (SIGKILL): the next writer goes ahead.
    package_model(recipe, {"model.onnx": onnx})
    assert (model_dir / "1" / "model.onnx").read_bytes() == b"other bytes"


def test_two_builds_of_one_recipe_at_once_the_second_is_refused(minilm_recipe, tmp_path: Path) -> None:
    from model_factory.locking import exclusive
    from model_factory.build.pipeline import build

    recipe = replace(minilm_recipe, repository=replace(minilm_recipe.repository, path=tmp_path / "repo"),
                     work_dir=tmp_path / "build" / "minilm")
    with exclusive(recipe.work_dir, "a build of minilm"):
        with pytest.raises(FactoryError, match=rf"a build of minilm is already running \(pid {os.getpid()}"):
            build(recipe)
    assert not (tmp_path / "repo").exists() and not list((tmp_path / "build").glob("minilm/*"))
