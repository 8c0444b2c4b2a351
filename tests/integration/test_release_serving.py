"""serve with a [release] policy on the real Triton: the current release serves; a rolled-back repository is
refused at start (every model, the attack named), with the trusted state kept in a state dir across restarts."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from tests.release_policy import released_policy

pytestmark = pytest.mark.integration
pytest.importorskip("tuf", reason="pip install 'model-factory[sign]' (python-tuf)")


def test_serve_refuses_a_rolled_back_repository_at_start(tmp_path, minilm_recipe, package_signed) -> None:
    from model_factory.errors import FactoryError
    from model_factory.serving.server import ServerOptions, start_verified_server
    from model_factory.signing import generate_keypair
    from model_factory.signing.release import add_release

    repo = tmp_path / "repo"
    keys = generate_keypair(tmp_path / "keys")
    recipe = replace(minilm_recipe, name="released", repository=replace(minilm_recipe.repository, path=repo))
    model_dir = package_signed(recipe, keys)
    assert (model_dir / "1").is_dir()
    # One key for every role keeps the test short; docs/releases.md keeps root offline and apart.
    policy, k = released_policy(repo, keys, tmp_path)
    release1 = tmp_path / "release-1"
    shutil.copytree(repo, release1)

    package_signed(replace(recipe, version=2), keys)
    assert (model_dir / "2").is_dir()
    assert add_release(repo, k, k, k) == 2

    server, report = start_verified_server(repo, ServerOptions(0, 0, 0), policy)
    try:
        assert report.served == ("released",), report.refused
    finally:
        assert server.stop() == 0
    assert (tmp_path / "state" / "timestamp.json").is_file()  # the trusted state outlives the server

    # Someone with write access to the storage puts release 1 back: all of it validly signed.
    shutil.rmtree(repo)
    shutil.copytree(release1, repo)
    with pytest.raises(FactoryError) as refused:
        start_verified_server(repo, ServerOptions(0, 0, 0), policy)
    assert "no model passed verification" in str(refused.value) and "rollback attack" in str(refused.value)
