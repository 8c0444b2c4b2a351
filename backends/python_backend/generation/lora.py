"""LoRA adapters served per request on one base: each row of a launch adds its own adapter's low-rank product.

The base graph is rewritten in memory at load (as ``int8_attention`` rewrites attention): for each projection
``MatMul`` some adapter targets (``lora_contract.graph_module``), ``Y = X·W`` becomes
``Y = X·W + ((X·Aᵀ) ⊙ mask)·B``: ``A`` [k, in] and ``B`` [k, out] are inputs holding the pairs of the adapters a
launch uses side by side (``A`` transposed, ``k`` = adapters x rank), ``lora_mask`` [batch, 1, k] has ones over each
row's own adapter's ``rank`` columns (none for a row of the base). So a prefill or decode launch mixes rows of the base
and of several adapters: one continuous batch, one launch per step; each row's own product survives the mask, the
others' are multiplied by zero (exact). A rank below the table's is zero-padded (exact). Each projection's columns are
as wide as the widest pair any adapter has for it (``ranks``), not the widest of any projection: Gemma's packed
``qkv_proj`` carries q, k and v's pairs side by side (rank 48 for rank-16 adapters) and the other projections 16, so a
mask per width (``lora_mask`` for the widest, ``lora_mask.<w>`` for each narrower) instead of every projection padded
to 48, which made 16 adapters cost 2.28x the base's CPU against 1.38x unpadded (docs/generation.md).

Measured against the first form, a ``Gather`` of each row's ``A`` and ``B`` and two batched MatMuls: that copied
every row's pairs, base rows too, at every step (a decode step of 8 rows on the 110M Llama copied about 140 MB), where
this reads each adapter in use once (``benchmarks/bench_lora.py``). Its cost is the columns of the adapters bound: a
launch binds its adapters' slots as a view of the stacks where they are contiguous, else a compact copy of them (made
again only when the set of slots or a slot's contents changes, so a decode of the same sequences reuses it); a
launch of base rows only binds ``k`` = 0 and adds nothing but empty products.

Why not ONNX Runtime's ``LoraAdapter`` / ``RunOptions.add_active_adapter``: one active adapter set per run, so a
step with rows of three adapters would be three launches (rows grouped per adapter), and onnxruntime-genai's builder
exports the LoRA inputs only when it builds the graph from the adapter, not onto a packaged, signed base.

:class:`AdapterTable` keeps up to ``max_loras`` adapters in the stacks (a slot each), loading one from its verified
files when a request names it and evicting the least recently used that no running sequence holds; a request for
an adapter when every slot is held waits for none: it is refused (UNAVAILABLE) as a full queue is. The stacks are
bound by pointer, written in place only in slots no running row reads.
"""

from __future__ import annotations

import io as _io
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..integrity import IntegrityError, read_checked, verified_digests
from ..lora_contract import (ADAPTER_SPEC, ADAPTER_WEIGHTS, LORA_MASK, AdapterSpec, adapter_entries, file_sha256,
                             graph_module, lora_inputs)


class AdapterError(Exception):
    """A request's adapter cannot be served: unknown, refused at load, or every slot held (``busy``)."""

    def __init__(self, message: str, busy: bool = False, unknown: bool = False) -> None:
        super().__init__(message)
        self.busy, self.unknown = busy, unknown


@dataclass(frozen=True)
class LoraGraph:
    """The base graph rewritten: its bytes, the folder of its external weights (or None), each module's (in, out),
    and each module's width where they differ (``ranks``; empty: one width, one mask)."""

    model: bytes
    weights_folder: Path | None
    shapes: dict[str, tuple[int, int]]
    ranks: dict[str, int] = field(default_factory=dict)


def mask_name(width: int, widest: int) -> str:
    """The graph input holding the row masks of the projections ``width`` wide: ``lora_mask`` for the widest."""
    return LORA_MASK if width == widest else f"{LORA_MASK}.{width}"


def pair_ranks(found: Sequence["Found"]) -> dict[str, int]:
    """Each module's widest pair over ``found`` adapters, read from their verified weight files."""
    ranks: dict[str, int] = {}
    for f in found:
        data = read_checked(f.folder.parent, f"{f.folder.name}/{ADAPTER_WEIGHTS}", f.digests)
        for module, (a, _b) in read_pairs(data).items():
            ranks[module] = max(ranks.get(module, 1), int(a.shape[1]))
    return ranks


def _weight_shape(node: Any, inits: dict[str, Any]) -> tuple[int, int]:
    if node.op_type == "MatMulNBits":
        attrs = {a.name: a.i for a in node.attribute}
        return int(attrs["K"]), int(attrs["N"])
    w = inits[node.input[1]]
    return int(w.dims[0]), int(w.dims[1])


def rewrite(model: Any, modules: Sequence[str], ranks: dict[str, int] | None = None) -> dict[str, tuple[int, int]]:
    """Add each of ``modules``' low-rank product to its MatMul in ``model`` (an onnx ModelProto, changed in place);
    returns each module's (in, out). ``ranks``: each module's width, the projections of one width masked by one input
    (:func:`mask_name`); None: one mask for all. ValueError naming a module the graph does not have."""
    from onnx import TensorProto, helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    wanted, shapes = set(modules), {}
    widths = {ranks.get(m, 1) for m in modules} if ranks else {1}
    widest = max(widths)
    added = [helper.make_tensor_value_info(mask_name(w, widest), TensorProto.FLOAT, ["lora_batch", 1, f"lora_k{w}"])
             for w in sorted(widths, reverse=True)]
    new_nodes = []
    for node in g.node:
        module = graph_module(node.name)
        new_nodes.append(node)
        if module not in wanted:
            continue
        fan_in, fan_out = _weight_shape(node, inits)
        shapes[module] = (fan_in, fan_out)
        a_name, b_name = lora_inputs(module)
        width = ranks.get(module, 1) if ranks else widest
        mask, k = mask_name(width, widest), f"lora_k{width}"
        added += [helper.make_tensor_value_info(a_name, TensorProto.FLOAT, [k, fan_in]),
                  helper.make_tensor_value_info(b_name, TensorProto.FLOAT, [k, fan_out])]
        out, base_out, p = node.output[0], node.output[0] + "/lora_base", f"/lora/{module}"
        node.output[0] = base_out
        # X·Aᵀ without a transposed copy: FusedMatMul (ONNX Runtime's contrib op) reads A [k, in] as transposed.
        new_nodes += [helper.make_node("FusedMatMul", [node.input[0], a_name], [p + "/XA"], name=p + "/MatMulA",
                                       domain="com.microsoft", transB=1, alpha=1.0),
                      helper.make_node("Mul", [p + "/XA", mask], [p + "/XAm"], name=p + "/Mask"),
                      helper.make_node("MatMul", [p + "/XAm", b_name], [p + "/XAB"], name=p + "/MatMulB"),
                      helper.make_node("Add", [base_out, p + "/XAB"], [out], name=p + "/Add")]
    missing = sorted(wanted - set(shapes))
    if missing:
        raise ValueError(f"the base graph has no projection {', '.join(missing)} (its MatMul nodes are named "
                         "/model/layers.N/attn|mlp/<proj>/MatMul)")
    del g.node[:]
    g.node.extend(new_nodes)
    g.input.extend(added)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return shapes


def prepare(source: Path | bytes, modules: Sequence[str], ranks: dict[str, int] | None = None) -> LoraGraph:
    """``source`` (the graph's bytes, or its path when its weights are external) with ``modules`` rewritten, each
    ``ranks`` wide where given (else one width)."""
    import onnx

    if isinstance(source, (bytes, bytearray)):
        model, folder = onnx.load_from_string(bytes(source)), None
    else:
        model, folder = onnx.load(str(source), load_external_data=False), Path(source).resolve().parent
    shapes = rewrite(model, modules, ranks)
    return LoraGraph(model.SerializeToString(), folder, shapes, dict(ranks or {}))


def prepare_or_refuse(source: Path | bytes, found: list, refused: dict[str, str], modules: list[str],
                      precision: str) -> LoraGraph | None:
    """``prepare(source, modules)``, or None with every adapter of ``found`` moved to ``refused`` (and ``found``,
    ``modules`` emptied) where the served graph has not the projections they add to: the base then loads and
    serves without them, each adapter's request answered with why (INT8 dynamic's graph computes a projection in
    integers, ``MatMulInteger``, under other node names: no ``MatMul`` to add to)."""
    if not modules:
        return None
    try:
        return prepare(source, modules, pair_ranks(found))
    except ValueError as exc:
        refused.update({f.spec.name: f"adapter {f.spec.name} is not served on this base's {precision} graph: {exc}. "
                        "Fix: serve the base at a precision whose projections are MatMul or MatMulNBits (fp32, int8 "
                        "weight-only, int4)" for f in found})
        found.clear()
        modules.clear()
        return None


def stacked(pairs: dict[str, tuple[np.ndarray, np.ndarray]], shapes: dict[str, tuple[int, int]],
            rank: int | dict[str, int]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One adapter's pairs zero-padded to ``rank`` (one width, or each module's) for every module of the table (zeros
    where it adds nothing)."""
    out = {}
    for module, (fan_in, fan_out) in shapes.items():
        r = rank.get(module, 1) if isinstance(rank, dict) else rank
        a, b = np.zeros((fan_in, r), np.float32), np.zeros((r, fan_out), np.float32)
        if module in pairs:
            pa, pb = pairs[module]
            a[:, :pa.shape[1]], b[:pb.shape[0], :] = pa, pb
        out[module] = (a, b)
    return out


def read_pairs(data: bytes) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``adapter.npz``'s bytes as module -> (A, B), float32 (no pickles: ``allow_pickle`` stays off)."""
    with np.load(_io.BytesIO(data), allow_pickle=False) as npz:
        names = {k.rsplit(".", 1)[0] for k in npz.files}
        return {m: (np.asarray(npz[m + ".A"], np.float32), np.asarray(npz[m + ".B"], np.float32)) for m in names}


@dataclass(frozen=True)
class Found:
    """An adapter entry this base serves: its spec and version folder, its verified digests (or None)."""

    spec: AdapterSpec
    folder: Path
    digests: dict[str, str] | None


def discover(version_dir: Path, base_digests: dict[str, str] | None,
             on_cpu: bool = True) -> tuple[list[Found], dict[str, str], list[str]]:
    """The adapters beside this base version (``<repository>/<adapter>/<v>``) that name it: ``(found, refused,
    the graph modules they add to)``, refused: adapter name -> why (not verified, changed after verification, built
    for another base, or on a GPU instance: adapters are served on CPU instances)."""
    model, version = version_dir.parent.name, int(version_dir.name)
    found, refused = [], {}
    for name, folder in adapter_entries(version_dir.parent.parent, model):
        try:
            digests = verified_digests(name, folder.name)
            spec = AdapterSpec.from_json(read_checked(folder.parent, f"{folder.name}/{ADAPTER_SPEC}", digests).decode())
        except (IntegrityError, ValueError, KeyError) as exc:
            refused[name] = f"adapter {name} is not served: {exc}"
            continue
        # Verified: the table holds every file of the base version. Unverified: the files of this view (serve copies
        # the served precision's weights only), at least one of them compared.
        ours = ({rel: base_digests.get(f"{version}/{rel}") for rel in spec.base_digests} if base_digests is not None
                else {rel: file_sha256(version_dir / rel) for rel in spec.base_digests
                      if (version_dir / rel).is_file()})
        wrong = [rel for rel, sha in sorted(spec.base_digests.items()) if rel in ours and ours[rel] != sha]
        if not ours:
            wrong = sorted(spec.base_digests) or ["its files"]
        if spec.base_version != version or wrong:
            refused[name] = (f"adapter {name} was built for {spec.base} version {spec.base_version} whose "
                             f"{', '.join(wrong) or 'version'} differ{'s' if len(wrong) == 1 else ''} from the served "
                             f"{model} version {version}: it is another base. Fix: rebuild the adapter against this "
                             "base (its recipe's adapter.base)")
            continue
        found.append(Found(spec, folder, digests))
    if not on_cpu:
        refused.update({f.spec.name: f"adapter {f.spec.name}: adapters are served on CPU instances" for f in found})
        found = []
    return found, refused, sorted({m for f in found for m in f.spec.modules})


class AdapterTable:
    """The loaded adapters' stacks, their slots (1.. ``max_loras``; 0 is the base) and users; the lock guards slots
    and counts. A module's stacks: ``A`` transposed [slots x rank, in] and ``B`` [slots x rank, out], slot ``s`` in
    rows ``(s - 1) x rank`` to ``s x rank``, so the slots a launch uses are one contiguous view of each."""

    def __init__(self, found: Sequence[Found], refused: dict[str, str], shapes: dict[str, tuple[int, int]],
                 max_loras: int, log: Callable[[str], None] = lambda m: None,
                 ranks: dict[str, int] | None = None) -> None:
        self.found = {f.spec.name: f for f in found}
        self.refused = dict(refused)
        self.max_loras = max(1, int(max_loras))
        # Each module's width: ``ranks`` (the graph's, LoraGraph.ranks) where given, else every module the widest.
        uniform = max((f.spec.rank for f in found), default=1)
        self.ranks = {m: (ranks.get(m, 1) if ranks else uniform) for m in shapes}
        self.rank = max(self.ranks.values(), default=uniform)  # the widest: lora_mask's
        slots = min(self.max_loras, len(found)) + 1
        self.stacks = {m: (np.zeros(((slots - 1) * self.ranks[m], i), np.float32),
                           np.zeros(((slots - 1) * self.ranks[m], o), np.float32)) for m, (i, o) in shapes.items()}
        self.shapes = dict(shapes)
        self.bytes = sum(a.nbytes + b.nbytes for a, b in self.stacks.values())
        self._slots: OrderedDict[str, int] = OrderedDict()  # loaded adapter -> slot, least recently used first
        self._users = [0] * slots
        self._loads = [0] * slots  # times each slot was written: a compact copy of older contents is remade
        self._compact: dict[str, tuple[np.ndarray, np.ndarray]] | None = None  # made at the first scattered launch
        self._compact_key: tuple = ()
        self._lock = threading.Lock()
        self._log = log

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.found))

    def loaded(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._slots)

    def running(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(n for n, s in self._slots.items() if self._users[s])

    def pair(self, module: str, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """``slot``'s pair of ``module`` as the adapter file holds it: ``A`` [in, rank], ``B`` [rank, out] (views)."""
        a, b = self.stacks[module]
        r = self.ranks[module]
        rows = slice((slot - 1) * r, slot * r)
        return a[rows].T, b[rows]

    def acquire(self, name: str) -> int:
        """``name``'s slot, its weights loaded (verified) into a free or least recently used idle slot first."""
        if name not in self.found:
            if name in self.refused:
                raise AdapterError(self.refused[name])
            raise AdapterError(f"no adapter {name!r} on this model (served: {', '.join(self.names) or 'none'})",
                               unknown=True)
        with self._lock:
            slot = self._slots.get(name)
            if slot is None:
                slot = self._free_slot()
                try:
                    self._load(self.found[name], slot)
                except (IntegrityError, OSError, ValueError, KeyError) as exc:
                    self.refused[name] = f"adapter {name} is not served: {exc}"
                    del self.found[name]
                    raise AdapterError(self.refused[name]) from None
                self._slots[name] = slot
            self._slots.move_to_end(name)
            self._users[slot] += 1
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self._users[slot] -= 1

    def _free_slot(self) -> int:
        used = set(self._slots.values())
        for s in range(1, len(self._users)):
            if s not in used:
                return s
        for name, s in self._slots.items():  # least recently used first
            if not self._users[s]:
                del self._slots[name]
                self._log(f"adapter {name} evicted (max_loras {self.max_loras})")
                return s
        raise AdapterError(f"all {self.max_loras} adapter slots (max_loras) are held by running requests: retry "
                           "later", busy=True)

    def _load(self, f: Found, slot: int) -> None:
        data = read_checked(f.folder.parent, f"{f.folder.name}/{ADAPTER_WEIGHTS}", f.digests)
        pairs = read_pairs(data)
        for module, (a, b) in stacked(pairs, self.shapes, self.ranks).items():
            sa, sb = self.pair(module, slot)
            sa[...], sb[...] = a, b
        self._loads[slot] += 1
        self._log(f"adapter {f.spec.name} version {f.spec.version} loaded into slot {slot} (rank {f.spec.rank})")

    def mask(self, rows: Sequence[int], width: int | None = None) -> tuple[np.ndarray, list[int]]:
        """``(lora_mask [len(rows), 1, k], the slots bound in column order)`` for a launch whose rows use ``rows``
        (0: the base): each row's ones over its own slot's ``width`` columns (the widest's by default)."""
        w = self.rank if width is None else int(width)
        used = sorted({int(r) for r in rows if r})
        at = {slot: i for i, slot in enumerate(used)}
        mask = np.zeros((len(rows), 1, len(used) * w), np.float32)
        for i, r in enumerate(rows):
            if r:
                mask[i, 0, at[int(r)] * w:(at[int(r)] + 1) * w] = 1.0
        return mask, used

    def _bound(self, used: list[int]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Each module's pairs of the ``used`` slots side by side: a view of the stacks where the slots are
        contiguous, else the compact copy (remade only when the slots or their contents changed)."""
        if not used or used[-1] - used[0] + 1 == len(used):
            first, last = (used[0] - 1, used[-1]) if used else (0, 0)
            return {m: (a[first * self.ranks[m]:last * self.ranks[m]], b[first * self.ranks[m]:last * self.ranks[m]])
                    for m, (a, b) in self.stacks.items()}
        key = tuple((s, self._loads[s]) for s in used)
        if self._compact_key != key:
            if self._compact is None:
                self._compact = {m: (np.empty_like(a), np.empty_like(b)) for m, (a, b) in self.stacks.items()}
            for m, (a, b) in self.stacks.items():
                ca, cb = self._compact[m]
                r = self.ranks[m]
                for i, s in enumerate(used):
                    ca[i * r:(i + 1) * r], cb[i * r:(i + 1) * r] = a[(s - 1) * r:s * r], b[(s - 1) * r:s * r]
            self._compact_key = key
        return {m: (a[:len(used) * self.ranks[m]], b[:len(used) * self.ranks[m]]) for m, (a, b) in self._compact.items()}

    def bind(self, io: Any, rows: Sequence[int]) -> None:
        """Bind ``lora_mask`` and the used slots' pairs (by pointer) on an I/O binding."""
        widths = sorted(set(self.ranks.values()) or {self.rank}, reverse=True)
        used: list[int] = []
        for w in widths:
            mask, used = self.mask(rows, w)
            io.bind_cpu_input(mask_name(w, widths[0]), mask)
        for module, pair in self._bound(used).items():
            for name, arr in zip(lora_inputs(module), pair):
                io.bind_input(name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data)
