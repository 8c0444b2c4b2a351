"""A rollout's candidate: the new version staged as ``<model>__candidate`` in ``serve``'s private second repository,
its digests added to the verified-digests table (the backend checks every byte it loads against them), accepted on
this machine, and dropped again once judged (``rollout.py`` runs these steps)."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from model_factory.errors import FactoryError
from model_factory.serving.rollout_plan import signed_config, version_config

def candidate_name(model: str) -> str:
    from model_factory.backend.operations.shadow import CANDIDATE_SUFFIX

    return model + CANDIDATE_SUFFIX



def candidate_config(base: dict[str, Any], version: int, name: str) -> dict[str, Any]:
    """The candidate's configuration: ``version`` alone under ``name``, and never decoupled. A text-generation
    candidate answers only the mirror's non-streamed requests, one response each, so it loads non-decoupled and
    the mirror calls it with a plain BLS ``exec()``. With ``exec(decoupled=True)`` on Triton 2.51, the serving
    version's unload after the switch crashed tritonserver in 2 of 3 runs of bench_rollout_generative under
    streamed load (SIGSEGV in the Python backend's ModelInstanceFinalize, in the log kept), and a serving stub
    died once in the shadow (a segfault in libpython's allocator)."""
    out = version_config(base, version, name)
    policy = out.get("model_transaction_policy") or {}
    if policy.get("decoupled"):
        out["model_transaction_policy"] = dict(policy, decoupled=False)
    return out



def stage_candidate(server: Any, verified: Any, model: str, version: int, serving: int,
                    digests: dict[str, str]) -> Path:
    """``<candidates>/<model>__candidate``: the version's verified files and a derived config.pbtxt; ``verified`` is
    ``serve``'s :class:`~.digests.VerifiedDigests` (its table gains the candidate's digests)."""
    from model_factory.build.repository import config_to_pbtxt
    from model_factory.build_engines.onnx_files import hardlink_or_copy
    from model_factory.serving.digests import read_table, write_table
    from model_factory.signing import signed_digests

    m, v = model, version
    src = Path(server.repository) / m
    cand = candidate_name(m)
    dst = Path(server.candidates_dir) / cand
    shutil.rmtree(dst, ignore_errors=True)
    for rel in digests:
        if rel.split("/", 1)[0] == str(v):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            hardlink_or_copy(src / rel, dst / rel)
    config = candidate_config(signed_config(src, v), v, cand)  # its own signed configuration
    (dst / "config.pbtxt").write_text(config_to_pbtxt(config))
    table = read_table(verified.path)
    table.setdefault(m, {})[str(v)] = digests
    table[cand] = {str(v): digests}
    try:  # the serving version again (one packaged before carrying its own config.pbtxt is re-signed with it)
        table[m][str(serving)] = signed_digests(src, int(serving), verified.policy)
    except FactoryError:
        pass  # keep what was verified when it started serving
    write_table(verified.path, table)
    return dst


def accept_candidate(cand_dir: Path, version: int, digests: dict[str, str], *, gpu_product: str | None = None,
                     int8_kernels: str | None = None) -> None:
    """The candidate's acceptance on this machine (its golden data through the engine the backend would load, in a
    child process); FactoryError with the reason when it fails."""
    from model_factory.serving.verified_start import check_on_this_machine

    checks = check_on_this_machine(cand_dir.parent, (cand_dir.name,), {cand_dir.name: {str(version): digests}},
                                   accept=True, gpu_product=gpu_product, int8_kernels=int8_kernels, yield_cores=True)
    if cand_dir.name not in checks.passed:
        raise FactoryError(checks.refused.get(cand_dir.name, "acceptance failed on this machine"))


def drop_candidate(server: Any, verified: Any, model: str) -> None:
    """The candidate's files and its entry in the verified-digests table removed."""
    from model_factory.serving.digests import read_table, write_table

    cand = candidate_name(model)
    shutil.rmtree(Path(server.candidates_dir) / cand, ignore_errors=True)
    if verified is not None:
        table = read_table(verified.path)
        if table.pop(cand, None) is not None:
            write_table(verified.path, table)


@contextmanager
def quiet_start(shadow_dir: Path, model: str) -> Iterator[None]:
    """Ask the instances ``model`` loads in the block to start quietly (``backend/quiet_start.py``)."""
    from model_factory.backend.engines.quiet_start import request_path

    path = request_path(shadow_dir, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
