"""A LoRA adapter's rollout: v1 -> v2 of an adapter entry while its base serves, and its undo.

An adapter (``lora_contract``: its own signed, versioned entry tied to the bytes of one base version) is no Triton
model: its base's stub finds the adapters beside it at its load (``generation/lora.py``). So a rollout of an adapter
(``model-factory rollout ADAPTER VERSION``, the same command, endpoint and states as a model's) is a reload of its
base with the new adapter version in the folder Triton reads:

1. **Refusals, before anything changes** (:func:`check_adapter`, one line each): the version is not newer than the
   one served; it fails verification or is not released (as a model version); it was built for another base: its
   ``adapter.json`` names another model or version than the base serving here, or base digests other than those
   ``serve`` verified for that version (the bytes the stub would check it against), named with the files that
   differ.
2. **Acceptance** as its gate (``serving/adapter_acceptance.py``: its build's gate on the held-out text passed, and
   the repository holds its base version with the bytes it was built on). An adapter is not mirrored: its stub is
   its base's, and a candidate base loaded beside the serving one to mirror it would double the base's memory.
3. **Switch** (:func:`switch_adapter`): the version's digests join the verified-digests table, the base's loads
   are set to find that version (``TritonServer.adapter_versions``, ``served_view.sync_adapter``), the base's serving
   version folder is marked changed (``served_view.mark_changed``) and the base loaded again with instance names of
   its own (``rollout_plan.version_config``'s reason): Triton loads the base version again in the background, the
   loaded one answering (its adapters as they were) until the new one is ready, then sends it every request; the new
   stubs load quietly. A load that fails leaves the loaded base serving, and the adapter's setting is put back.
4. **Undo** within the grace period: the same switch back to the previous version (nothing is kept loaded: the
   base's stubs are loaded again, with the previous adapter version's files, still in the served folder).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from model_factory.errors import FactoryError


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter entry a served base's stubs found: its name, its base and the version they serve."""

    name: str
    base: str
    version: int


def served_adapters(server: Any, bases: Mapping[str, int]) -> dict[str, ServedAdapter]:
    """The adapter entries of the served bases in the folder Triton reads (the newest version holding
    ``adapter.json``: what each base's stubs found at their load)."""
    from model_factory.backend.lora_contract import adapter_entries

    view = getattr(server, "served_repository", None)
    if view is None:
        return {}
    return {name: ServedAdapter(name, base, int(folder.name))
            for base in sorted(bases) for name, folder in adapter_entries(Path(view), base)}


def check_adapter(server: Any, verified: Any, adapter: ServedAdapter, version: int,
                  base_serving: int) -> dict[str, str]:
    """Refuse (FactoryError, one line) a rollout of ``adapter`` to ``version`` that must not start; return the
    version's verified digests. ``verified``: ``serve``'s :class:`~.digests.VerifiedDigests` (with a policy that has
    ``[release]``: the caller checked); ``base_serving``: the version its base serves."""
    from model_factory.backend.integrity import read_checked
    from model_factory.backend.lora_contract import ADAPTER_SPEC, AdapterSpec
    from model_factory.serving.digests import read_table
    from model_factory.signing import signed_digests
    from model_factory.signing.release import release_dir
    from model_factory.signing.release_check import verify_release_files

    name, repo = adapter.name, Path(server.repository)
    if version <= adapter.version:
        raise FactoryError(f"refused: adapter {name} version {version} is not newer than the serving version "
                           f"{adapter.version} (rollback protection). Fix: within the grace period use rollout --undo; "
                           "else release the older adapter again under a higher version")
    model_dir = repo / name
    if not (model_dir / str(version) / ADAPTER_SPEC).is_file():
        raise FactoryError(f"refused: {model_dir / str(version)} holds no adapter version ({ADAPTER_SPEC}). Fix: "
                           f"build or pull adapter {name} version {version} into the repository serve reads")
    try:
        digests = signed_digests(model_dir, version, verified.policy)
        spec = AdapterSpec.from_json(read_checked(model_dir, f"{version}/{ADAPTER_SPEC}", digests).decode())
    except FactoryError as exc:
        raise FactoryError(f"refused: {' '.join(str(exc).split())}") from None
    except Exception as exc:  # noqa: BLE001 - an unreadable adapter.json: that is the refusal
        raise FactoryError(f"refused: adapter {name} version {version}: {type(exc).__name__}: {exc}") from None
    verdict = verify_release_files(release_dir(repo), model_dir, version, verified.policy)
    if not verdict.ok:
        raise FactoryError(f"refused: not released: {' '.join(' '.join(verdict.all_problems()).split())}")
    base = adapter.base
    served = read_table(verified.path).get(base, {}).get(str(base_serving), {})
    wrong = sorted(rel for rel, sha in spec.base_digests.items() if served.get(f"{base_serving}/{rel}") != sha)
    if spec.base != base or spec.base_version != base_serving or wrong or not spec.base_digests:
        differ = (f"whose {', '.join(wrong)} differ{'s' if len(wrong) == 1 else ''} from" if wrong and spec.base == base
                  else "and not")
        raise FactoryError(f"refused: adapter {name} version {version} was built for {spec.base} version "
                           f"{spec.base_version} {differ} the {base} version {base_serving} serving here: it is "
                           f"another base. Fix: rebuild the adapter against {base} version {base_serving} (its "
                           "recipe's adapter.base)")
    return digests


def accept_adapter_version(server: Any, name: str, version: int, digests: Mapping[str, str]) -> str:
    """The adapter version's acceptance (its gate): the verdict in words, or FactoryError with the reason."""
    from model_factory.serving.adapter_acceptance import accept_adapter

    found = accept_adapter(Path(server.repository) / name, digests, version=version)
    if not found.get("passed"):
        raise FactoryError(f"acceptance failed on this machine: {found.get('reason')}")
    return (f"passed: its build's gate (perplexity ratio {found.get('score'):.4f}, at most "
            f"{found.get('threshold'):g}) on {found.get('engine')}, whose bytes this repository holds")


def switch_adapter(server: Any, verified: Any, adapter: ServedAdapter, version: int, base_version: int,
                   digests: Mapping[str, str] | None, instance_tag: str, timeout_s: float) -> None:
    """Reload ``adapter``'s base with ``version`` of the adapter (see the module docstring); the base's loaded
    version answers meanwhile. ``digests``: the version's verified digests, added to the table (None: already
    there, an undo). ``instance_tag``: told apart from the running instances' names. FactoryError when the base does
    not load again: the adapter's setting is put back (the loaded base keeps serving)."""
    from model_factory.serving.digests import read_table, write_table
    from model_factory.serving.refusals import load_error_line
    from model_factory.serving.served_view import mark_changed, sync_adapter

    if digests is not None:
        table = read_table(verified.path)
        table.setdefault(adapter.name, {})[str(version)] = dict(digests)
        write_table(verified.path, table)
    base = adapter.base
    previous_config = server.load_configs.get(base)
    config = json.loads(previous_config) if previous_config else None
    if config is not None:
        config["instance_group"] = [dict(g, name=f"{base}_v{int(base_version)}_{instance_tag}_{i}")
                                    for i, g in enumerate(config.get("instance_group") or [{}])]
        server.load_configs[base] = json.dumps(config)
    server.adapter_versions[adapter.name] = int(version)
    sync_adapter(server.repository, server.served_repository, adapter.name, version)
    mark_changed(server.served_repository, base, base_version)
    error = server.load_model(base, timeout_s=timeout_s)
    if error:
        server.adapter_versions[adapter.name] = adapter.version
        sync_adapter(server.repository, server.served_repository, adapter.name, adapter.version)
        if previous_config is not None:
            server.load_configs[base] = previous_config
        raise FactoryError(f"the base {base} did not load again with adapter {adapter.name} version {version} (it "
                           f"serves on as it was): {load_error_line(error)}")
