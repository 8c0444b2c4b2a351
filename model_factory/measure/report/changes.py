"""Section "what changed": this release against an older one (``--against OLD_REPO``).

The older release is the highest version of the same model in the other repository.
Compared: accuracy per precision (and the layers INT8 keeps in float), latency and
throughput per concurrency (when both sweeps are given), sizes, files (by the digests
``metadata.json`` records), the source and calibration data digests, the signer, and the tensors
(from both versions' signed BOMs: which tensors of the source and of each ONNX file changed, or
"identical weights"), and the data contract (``model-factory contract diff``'s library function: an input
gone, a limit lowered, a golden text tokenized differently are breaking changes, named first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from model_factory.measure.report.accuracy import Accuracy
from model_factory.measure.report.built import Built
from model_factory.measure.report.release import Release
from model_factory.measure.report.trust import Trust


@dataclass(frozen=True)
class Delta:
    """One compared quantity: old and new values and whether they differ."""

    what: str
    old: Any
    new: Any
    unit: str = ""

    @property
    def changed(self) -> bool:
        return self.old != self.new

    @property
    def difference(self) -> float | None:
        if isinstance(self.old, (int, float)) and isinstance(self.new, (int, float)):
            diff = self.new - self.old
            # Scores are shown with 6 decimals: a difference below that is no change to the reader.
            return 0.0 if isinstance(diff, float) and abs(diff) < 5e-7 else diff
        return None


@dataclass(frozen=True)
class FileChange:
    path: str
    change: str  # "added", "removed", "changed"
    old_size: int | None
    new_size: int | None


@dataclass(frozen=True)
class ContractChange:
    """One difference between the two versions' data contracts (``data_contract.Change``)."""

    what: str
    breaking: bool


@dataclass(frozen=True)
class Changes:
    old_repo: str
    old_title: str
    accuracy: tuple[Delta, ...]
    float_nodes_added: tuple[str, ...]
    float_nodes_removed: tuple[str, ...]
    speed: tuple[Delta, ...]
    sizes: tuple[Delta, ...]
    files: tuple[FileChange, ...]
    files_unchanged: int
    provenance: tuple[Delta, ...]
    signer: Delta
    # One line per tensor set both BOMs list (model-factory diff's lines); empty when a BOM lacks tensors.
    tensors: tuple[str, ...] = ()
    # The data contract's changes (breaking ones first); contract_error: why the contracts could not be compared.
    contract: tuple[ContractChange, ...] = ()
    contract_error: str | None = None

    @property
    def breaking(self) -> tuple[ContractChange, ...]:
        return tuple(c for c in self.contract if c.breaking)

    @property
    def summary(self) -> str:
        moved = [d.what for d in self.accuracy if d.changed] + [d.what for d in self.sizes if d.changed]
        contract = ("data contract not compared" if self.contract_error else
                    f"{len(self.breaking)} breaking contract change(s)" if self.breaking else "no breaking change")
        return (f"{contract}; {len(self.files)} files differ, {self.files_unchanged} unchanged; "
                f"{'signer changed' if self.signer.changed else 'same signer'}; "
                f"{len(moved)} accuracy/size figures moved")


def _calibration(built_meta: Mapping[str, Any]) -> str | None:
    return ((built_meta.get("build") or {}).get("quantization") or {}).get("calibration_digest")


def _float_nodes(acc: Accuracy) -> list[str]:
    return [k.node for k in acc.kept]


def _speed(new: Sequence[Mapping[str, Any]], old: Sequence[Mapping[str, Any]]) -> list[Delta]:
    old_by = {p["concurrency"]: p for p in old}
    out = []
    for p in new:
        o = old_by.get(p["concurrency"])
        if o is None:
            continue
        out.append(Delta(f"p99 latency at c={p['concurrency']}", o["p99_ms"], p["p99_ms"], "ms"))
        out.append(Delta(f"throughput at c={p['concurrency']}", o["throughput"], p["throughput"], "seq/s"))
    return out


def compare(new: Release, old: Release, *, new_built: Built, old_built: Built, new_acc: Accuracy, old_acc: Accuracy,
            new_trust: Trust, old_trust: Trust, new_points: Sequence[Mapping[str, Any]] = (),
            old_points: Sequence[Mapping[str, Any]] = ()) -> Changes:
    """Everything that differs between ``old`` and ``new`` (sections already collected for both)."""
    old_rows = {r.precision: r for r in old_acc.rows}
    accuracy = [Delta(f"{r.precision} {r.metric}", old_rows[r.precision].score if r.precision in old_rows else None,
                      r.score) for r in new_acc.rows]
    accuracy += [Delta(f"{p} {r.metric}", r.score, None) for p, r in old_rows.items()
                 if p not in {x.precision for x in new_acc.rows}]
    new_float, old_float = _float_nodes(new_acc), _float_nodes(old_acc)
    old_art = {a.name: a.size for a in old_built.artifacts}
    new_art = {a.name: a.size for a in new_built.artifacts}
    sizes = [Delta("version folder", old.total_bytes, new.total_bytes, "bytes")]
    sizes += [Delta(name, old_art.get(name), new_art.get(name), "bytes")
              for name in sorted(set(old_art) | set(new_art))]
    old_files = {f.path: f for f in old.files}
    new_files = {f.path: f for f in new.files}
    files, unchanged = [], 0
    for path in sorted(set(old_files) | set(new_files)):
        o, n = old_files.get(path), new_files.get(path)
        if o is None:
            files.append(FileChange(path, "added", None, n.size if n else None))
        elif n is None:
            files.append(FileChange(path, "removed", o.size, None))
        elif (o.sha256, o.size) != (n.sha256, n.size) or (o.sha256 is None and n.sha256 is None):
            # metadata.json lists no digest of itself; compare it (and unlisted files) by their bytes
            if o.sha256 is None and n.sha256 is None and _same_bytes(old, new, path):
                unchanged += 1
                continue
            files.append(FileChange(path, "changed", o.size, n.size))
        else:
            unchanged += 1
    provenance = [Delta("source model digest", old_built.source_digest, new_built.source_digest),
                  Delta("calibration data digest", _calibration(old.metadata), _calibration(new.metadata)),
                  Delta("served precision", old_built.served_precision, new_built.served_precision)]
    signer = Delta("signer (as the bundle names it)", old_trust.signer or "unsigned", new_trust.signer or "unsigned")
    return Changes(str(old.repo), old.title, tuple(accuracy), tuple(n for n in new_float if n not in old_float),
                   tuple(n for n in old_float if n not in new_float), tuple(_speed(new_points, old_points)),
                   tuple(sizes), tuple(files), unchanged, tuple(provenance), signer, _tensors(old, new),
                   *_contract(old, new))


def _contract(old: Release, new: Release) -> tuple[tuple[ContractChange, ...], str | None]:
    """What ``model-factory contract diff OLD NEW`` says (breaking changes first), or why it cannot say."""
    from model_factory.build.data_contract import diff_contracts, load_contract
    from model_factory.errors import FactoryError

    try:
        changes = diff_contracts(load_contract(old.version_dir), load_contract(new.version_dir))
    except (FactoryError, OSError, ValueError, KeyError) as exc:
        return (), str(exc)
    return tuple(ContractChange(c.what, c.breaking) for c in sorted(changes, key=lambda c: not c.breaking)), None


def _tensors(old: Release, new: Release) -> tuple[str, ...]:
    """What ``model-factory diff`` says about the two versions' tensors, when both BOMs list them."""
    from model_factory.errors import FactoryError
    from model_factory.signing.tensors import diff_paths

    try:
        return tuple(line for d in diff_paths(old.version_dir, new.version_dir) for line in d.lines())
    except (FactoryError, OSError, ValueError):
        return ()


def _same_bytes(old: Release, new: Release, path: str) -> bool:
    a, b = old.version_dir / path, new.version_dir / path
    try:
        return a.read_bytes() == b.read_bytes() if a.stat().st_size < (64 << 20) else False
    except OSError:
        return False
