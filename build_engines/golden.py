"""Acceptance data ("golden outputs") for a version folder: held-out inputs and FP32 reference outputs.

``package`` writes three files into ``<version>/acceptance/``, so the version's signature covers them:

* ``inputs.json`` — the inputs, as Polygraphy's JSON list of feed dicts (one dict per iteration);
* ``outputs.json`` — the FP32 model's outputs on them (ONNX Runtime, CPU), as Polygraphy ``RunResults``
  from one runner, ``fp32-reference``;
* ``acceptance.json`` — the task, the gate metric and threshold, the output it is scored on, the
  sequence length and the optimization profile that covers it, and where the samples came from.

The inputs come from the recipe's *held-out* data (never the calibration set: with no
``heldout_data`` the same deterministic split as the quantize stage holds every 5th sample out).
Every iteration is padded to one sequence length, so one optimization profile covers all of them and
Polygraphy's CLI can replay them with ``--optimization-profile``. Written with Polygraphy's own JSON
functions, so ``polygraphy run … --load-inputs inputs.json --load-outputs outputs.json`` reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from model_factory.backend.contract import Files
from model_factory.errors import FactoryError, require
from model_factory.fileio import atomic_dir
from model_factory.recipe import Recipe

ACCEPTANCE_DIR = Files.ACCEPTANCE_DIR
INPUTS_FILE = Files.ACCEPTANCE_INPUTS
OUTPUTS_FILE = Files.ACCEPTANCE_OUTPUTS
SPEC_FILE = Files.ACCEPTANCE_SPEC
REFERENCE_RUNNER = "fp32-reference"
# The threshold when the recipe sets no quantization.min_accuracy (also the quantize stage's default target).
DEFAULT_THRESHOLD = 0.99
MAX_SAMPLES = 32
ITERATION_SAMPLES = 8


def polygraphy(extra: str = "onnx") -> Any:
    """Import polygraphy quietly (it logs every save at INFO and asks for the optional 'colored').

    ``extra`` names the pip extra in the error when it is missing: ``onnx`` where the data is written
    (the factory), ``serve`` where it is read (the serving machine).
    """
    require("polygraphy", extra)
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR
    import polygraphy.comparator
    import polygraphy.json

    return polygraphy


@dataclass(frozen=True)
class AcceptanceSpec:
    """What ``acceptance.json`` says: how an engine's outputs are scored against the references."""

    task: str
    metric: str  # the task's metric, as accuracy.task_metrics names it (cosine, top1, token_top1, ranking, ...)
    threshold: float
    primary_output: str
    outputs: tuple[str, ...]
    inputs: tuple[str, ...]
    samples: int
    iterations: int
    sequence_length: int | None
    optimization_profile: int
    reference: str
    heldout: str
    groups: tuple[str, ...] | None = None  # rerankers: the query of each sample, for the ranking agreement

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "metric": self.metric, "threshold": self.threshold,
                "primary_output": self.primary_output, "outputs": list(self.outputs), "inputs": list(self.inputs),
                "samples": self.samples, "iterations": self.iterations, "sequence_length": self.sequence_length,
                "optimization_profile": self.optimization_profile, "reference": self.reference,
                "heldout": self.heldout, "inputs_file": INPUTS_FILE, "outputs_file": OUTPUTS_FILE,
                "reference_runner": REFERENCE_RUNNER, "groups": None if self.groups is None else list(self.groups)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AcceptanceSpec":
        try:
            return cls(str(d["task"]), str(d["metric"]), float(d["threshold"]), str(d["primary_output"]),
                       tuple(d["outputs"]), tuple(d["inputs"]), int(d["samples"]), int(d["iterations"]),
                       None if d.get("sequence_length") is None else int(d["sequence_length"]),
                       int(d.get("optimization_profile", 0)), str(d.get("reference", "")), str(d.get("heldout", "")),
                       None if d.get("groups") is None else tuple(str(g) for g in d["groups"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise FactoryError(f"{SPEC_FILE} is malformed ({exc!r}). Fix: repackage the model with model-factory "
                               "package") from exc


def gate_threshold(recipe: Recipe) -> float:
    """The acceptance threshold: the recipe's accuracy gate, else :data:`DEFAULT_THRESHOLD`."""
    gate = recipe.quantization.min_accuracy
    return float(gate) if gate is not None else DEFAULT_THRESHOLD


def _profile_for(length: int | None, buckets: tuple[int, ...]) -> int:
    if length is None:
        return 0
    return next((i for i, b in enumerate(buckets) if length <= b), len(buckets) - 1)


def write_acceptance_data(recipe: Recipe, fp32_onnx: Path, tokenizer_dir: Path | None, out_dir: Path,
                          progress: Callable[[str], None] | None = None) -> Path | None:
    """Write ``out_dir/{inputs,outputs,acceptance}.json`` (atomically); None when the recipe has no data.

    Without any quantization data (an FP32-only recipe with neither ``calibration_data`` nor
    ``heldout_data``) there is nothing held out to accept on: the caller packages without acceptance
    data and ``accept`` says so.
    """
    from model_factory.build_engines.accuracy import primary_output, task_metrics
    from model_factory.build_engines.calibration import InputEncoder, split_data
    from model_factory.build_engines.export import onnxruntime_session
    from model_factory.build_engines.calibration import input_types

    say = progress or (lambda _m: None)
    q = recipe.quantization
    if q.calibration_data is None and q.heldout_data is None:
        say("[package] no quantization data in the recipe: no acceptance data written (accept will refuse)")
        return None
    split = split_data(q, need_calibration=False)
    held = split.heldout.select(range(min(len(split.heldout), MAX_SAMPLES)))
    session = onnxruntime_session(fp32_onnx)
    types = input_types(session)
    feeds = InputEncoder(types, tokenizer_dir, recipe.shapes.max_sequence_length).encode(held)
    outputs = [o.name for o in session.get_outputs()]
    n = int(next(iter(feeds.values())).shape[0])
    seq_len = None
    seq_names = [s.name for s in recipe.inputs if s.dims and s.dims[0] == -1 and s.name in feeds]
    if seq_names:
        seq_len = int(feeds[seq_names[0]].shape[1])
    pg = polygraphy()
    iterations, results = [], []
    for start in range(0, n, ITERATION_SAMPLES):
        it = {k: np.ascontiguousarray(v[start:start + ITERATION_SAMPLES]) for k, v in feeds.items()}
        outs = session.run(outputs, it)
        iterations.append(it)
        results.append(pg.comparator.IterationResult(dict(zip(outputs, outs)), runner_name=REFERENCE_RUNNER))
    primary = primary_output(recipe.task, outputs)
    ref = np.concatenate([np.asarray(r[primary].numpy() if hasattr(r[primary], "numpy") else r[primary])
                          for r in results])
    groups = held.groups() if hasattr(held, "groups") else None
    ref = ref.astype(np.float64)
    metric = task_metrics(ref, ref, recipe.task, feeds.get("attention_mask"), groups)[0]
    spec = AcceptanceSpec(recipe.task, metric, gate_threshold(recipe), primary, tuple(outputs), tuple(feeds), n,
                          len(iterations), seq_len, _profile_for(seq_len, recipe.shapes.sequence_buckets),
                          "FP32 ONNX (model.onnx) on ONNX Runtime CPU", f"{held.source.name}: {split.note}",
                          None if groups is None else tuple(groups))
    with atomic_dir(Path(out_dir)) as tmp:
        pg.json.save_json(iterations, str(tmp / INPUTS_FILE))
        pg.comparator.RunResults([(REFERENCE_RUNNER, results)]).save(str(tmp / OUTPUTS_FILE))
        (tmp / SPEC_FILE).write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
    say(f"[package] acceptance data: {n} held-out samples, {metric} >= {spec.threshold:g} on {primary}")
    return Path(out_dir)


def read_spec(data: bytes) -> AcceptanceSpec:
    """Parse ``acceptance.json`` bytes."""
    try:
        return AcceptanceSpec.from_dict(json.loads(data))
    except ValueError as exc:
        raise FactoryError(f"{SPEC_FILE} is not JSON ({exc}). Fix: repackage the model") from exc


def read_inputs(data: bytes) -> list[dict[str, np.ndarray]]:
    """Parse Polygraphy's inputs JSON (bytes) into a list of feed dicts."""
    pg = polygraphy("serve")
    feeds = pg.json.from_json(data.decode())
    return [{k: np.asarray(v) for k, v in it.items()} for it in feeds]


def read_outputs(data: bytes) -> list[dict[str, np.ndarray]]:
    """Parse Polygraphy ``RunResults`` JSON (bytes): the reference runner's outputs per iteration."""
    pg = polygraphy("serve")
    results = pg.comparator.RunResults.from_json(data.decode())
    runs = [its for name, its in results.items() if name == REFERENCE_RUNNER]
    if not runs:
        raise FactoryError(f"{OUTPUTS_FILE} has no '{REFERENCE_RUNNER}' run. Fix: repackage the model")
    return [{k: np.asarray(v.numpy() if hasattr(v, "numpy") else v) for k, v in it.items()} for it in runs[0]]
