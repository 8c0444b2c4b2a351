"""Shadow mirroring inside a serving stub: a share of live requests sent again to a candidate, answers compared.

``model-factory rollout`` (``model_factory.serving.rollout``) loads a candidate version under its own name
(``<model>__candidate``) and writes a control file, ``<runtime dir>/shadow/<model>.json``
(``{"id", "target", "share"}``). While that file exists, each instance of ``<model>`` hands a share of the
requests it answered — their inputs and the outputs it sent — to a background thread, which sends the same
inputs to the target through BLS (``pb_utils.InferenceRequest(...).exec()``), scores the candidate's outputs
against the served ones and keeps a tally in ``<runtime dir>/shadow/<model>.<instance>.tally.json``: requests
mirrored, the sum and minimum of their scores, the candidate's errors, and the worst cases by input hash
(never the input). A client never waits on any of it: the queue is bounded and a full queue skips the
request (counted). The candidate's answers reach no client.

Scores (:func:`agreement`): per output row, cosine similarity of float outputs (embeddings, logits), and for a
classification model also whether the top-1 class is the same (1 or 0); a request's score is its lowest. A
text-generation model (``generation``) mirrors only requests whose tokens are reproducible (greedy, or sampled
with a seed) once they ended, with the same prompt ids and sampling parameters as one non-streamed request to
the candidate (loaded non-decoupled for this: a plain ``exec()``), and scores :func:`token_agreement`: the tokens both
generated alike from the first on, over the longer of the two (1: the same continuation; a reduced precision
departs at its first differing token and never returns, as acceptance's free-running figure says).
Standard library and numpy only: this runs inside Triton's stub.
"""

from __future__ import annotations

import json
import os
import queue
import random
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

SHADOW_DIR = "shadow"  # beneath MODEL_FACTORY_RUNTIME_DIR (serve's private work folder)
CANDIDATE_SUFFIX = "__candidate"
WORST_KEPT = 5
_CHECK_EVERY_S = 0.25  # how often a stub looks for the control file
_WRITE_EVERY_S = 0.2  # how often a busy mirror rewrites its tally
GENERATED_IDS = "output_ids"  # a text-generation model's generated token ids (contract.GENERATE_OUTPUTS)


def yield_cores_if_candidate(model_name: str) -> bool:
    """A rollout's candidate (``<model>__candidate``) answers only mirrored copies, never a client: its stub runs
    at the lowest CPU priority (nice 19) so that it takes the cores live traffic leaves. Called first in
    ``initialize``: the threads the engine starts afterwards inherit it (Linux keeps a nice value per thread).
    True when lowered."""
    from ..batching.idle_cores import yield_cores

    return model_name.endswith(CANDIDATE_SUFFIX) and yield_cores()


def control_path(folder: Path, model: str) -> Path:
    """The control file that turns mirroring of ``model`` on (written by the rollout, removed to stop)."""
    return Path(folder) / f"{model}.json"


def tally_path(folder: Path, model: str, instance: str) -> Path:
    """One instance's tally of a mirrored model."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in instance) or "instance"
    return Path(folder) / f"{model}.{safe}.tally.json"


def shadow_folder(environ: Mapping[str, str] | None = None) -> Path | None:
    """``$MODEL_FACTORY_RUNTIME_DIR/shadow``, or None when the server was not started by ``serve``."""
    from ..batching.idle_cores import RUNTIME_DIR_ENV

    env = os.environ if environ is None else environ
    base = env.get(RUNTIME_DIR_ENV, "").strip()
    return Path(base) / SHADOW_DIR if base else None


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.reshape(a.shape[0], -1).astype(np.float64)
    b = b.reshape(b.shape[0], -1).astype(np.float64)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    both_zero = (na == 0) & (nb == 0)
    cos = (a * b).sum(axis=1) / np.maximum(na * nb, 1e-30)
    return np.where(both_zero, 1.0, cos)


def agreement(served: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray], classification: bool = False
              ) -> float:
    """How far the candidate's outputs agree with the served ones, in [-1, 1] (1: the same): the lowest, over
    float outputs and their rows, of the cosine similarity and (``classification``) the top-1 match."""
    scores = [1.0]
    for name, ref in served.items():
        ref = np.asarray(ref)
        if ref.dtype.kind != "f":
            continue
        got = candidate.get(name)
        if got is None or np.asarray(got).shape != ref.shape:
            return 0.0
        got = np.asarray(got)
        if ref.ndim == 0:
            ref, got = ref.reshape(1, 1), got.reshape(1, 1)
        elif ref.ndim == 1:
            ref, got = ref.reshape(1, -1), got.reshape(1, -1)
        if not (np.isfinite(got).all()):
            return 0.0
        scores.append(float(_cosine(ref, got).min()))
        if classification and ref.shape[-1] > 1:
            same = np.argmax(ref, axis=-1) == np.argmax(got, axis=-1)
            scores.append(float(same.all()))
    return min(scores)


def token_agreement(served: Any, candidate: Any) -> float:
    """The share of the served continuation the candidate generated alike from the first token on, over the
    longer of the two, in [0, 1]: 1 when both generated the same tokens (two empty ones included)."""
    a = [int(t) for t in np.asarray(served).reshape(-1)]
    b = [int(t) for t in np.asarray(candidate).reshape(-1)]
    longest = max(len(a), len(b))
    if longest == 0:
        return 1.0
    same = 0
    for x, y in zip(a, b):
        if x != y:
            break
        same += 1
    return same / longest


class Tally:
    """What one instance mirrored for one rollout (``id``)."""

    def __init__(self, rollout_id: str) -> None:
        self.id = rollout_id
        self.mirrored = 0
        self.score_sum = 0.0
        self.min_score: float | None = None
        self.errors = 0
        self.skipped = 0
        self.worst: list[tuple[float, str]] = []  # (score, input hash), lowest first

    def add(self, score: float, input_hash: str, error: str | None = None) -> None:
        self.mirrored += 1
        self.errors += error is not None
        self.score_sum += score
        self.min_score = score if self.min_score is None else min(self.min_score, score)
        self.worst = sorted(self.worst + [(score, input_hash)])[:WORST_KEPT]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "mirrored": self.mirrored, "score_sum": self.score_sum, "min_score": self.min_score,
                "errors": self.errors, "skipped": self.skipped,
                "worst": [{"score": s, "input_hash": h} for s, h in self.worst]}


class ShadowMirror:
    """One instance's mirror: :meth:`active` (the control, read at most every 0.25 s), :meth:`offer` (a request
    it answered), :meth:`close`. ``pb_utils`` is Triton's module (BLS); ``folder`` the shadow folder."""

    def __init__(self, pb_utils: Any, folder: Path | None, model: str, instance: str, classification: bool = False,
                 hash_inputs: Callable[[list], str] | None = None, log: Callable[[str], None] | None = None,
                 queue_size: int = 64, generation: bool = False) -> None:
        self.pb_utils, self.folder, self.model, self.instance = pb_utils, folder, model, instance
        self.classification = classification
        self.generation = generation  # a decoupled text-generation model: output_ids scored by token_agreement
        self.hash_inputs = hash_inputs or (lambda parts: "unhashed")
        self.log = log or (lambda _m: None)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._control: dict | None = None
        self._checked = 0.0
        self._tally: Tally | None = None
        self._written = 0.0
        self._lock = threading.Lock()

    def active(self) -> dict | None:
        """The control in force (``{"id", "target", "share"}``), or None: mirroring off."""
        if self.folder is None:
            return None
        now = time.monotonic()
        if now - self._checked >= _CHECK_EVERY_S:
            self._checked = now
            try:
                control = json.loads(control_path(self.folder, self.model).read_text())
                self._control = control if isinstance(control, dict) and control.get("target") else None
            except (OSError, ValueError):
                self._control = None
        return self._control

    def offer(self, control: dict, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """Mirror one answered request (a share of them: ``control["share"]``); never blocks."""
        if random.random() >= float(control.get("share", 1.0)):
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mf-shadow", daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait((control["id"], control["target"], dict(inputs), dict(outputs)))
        except queue.Full:
            with self._lock:
                tally = self._tally_for(control["id"])
                tally.skipped += 1

    def _tally_for(self, rollout_id: str) -> Tally:
        if self._tally is None or self._tally.id != rollout_id:
            self._tally = Tally(rollout_id)
        return self._tally

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            rollout_id, target, inputs, outputs = item
            now = self.active()
            if now is None or now.get("id") != rollout_id:
                continue  # that rollout stopped mirroring: its candidate is being unloaded, nothing to score
            error, score = None, 0.0
            try:
                if self.generation:
                    score = token_agreement(outputs[GENERATED_IDS], self._candidate_generation(target, inputs))
                else:
                    got = self._candidate_outputs(target, inputs, list(outputs))
                    score = agreement(outputs, got, self.classification)
            except Exception as exc:  # noqa: BLE001 - the candidate failed this request: a disagreement
                error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                tally = self._tally_for(rollout_id)
                tally.add(score, self.hash_inputs([inputs[k] for k in sorted(inputs)]), error)
            self._write(force=self._queue.empty())

    def _candidate_outputs(self, target: str, inputs: Mapping[str, np.ndarray], names: list) -> dict:
        pb = self.pb_utils
        request = pb.InferenceRequest(model_name=target, inputs=[pb.Tensor(n, a) for n, a in inputs.items()],
                                      requested_output_names=names)
        response = request.exec()
        if response.has_error():
            raise RuntimeError(response.error().message())
        out = {}
        for name in names:
            tensor = pb.get_output_tensor_by_name(response, name)
            if tensor is not None:
                out[name] = tensor.as_numpy()
        return out

    def _candidate_generation(self, target: str, inputs: Mapping[str, np.ndarray]) -> list[int]:
        """The token ids the candidate generates for ``inputs`` (``stream`` false: one response). The rollout loads
        a text-generation candidate non-decoupled (``serving/rollout_candidate.py``), so this is a plain BLS request."""
        pb = self.pb_utils
        request = pb.InferenceRequest(model_name=target, inputs=[pb.Tensor(n, a) for n, a in inputs.items()],
                                      requested_output_names=[GENERATED_IDS])
        response = request.exec()
        if response.has_error():
            raise RuntimeError(response.error().message())
        tensor = pb.get_output_tensor_by_name(response, GENERATED_IDS)
        return [] if tensor is None else [int(t) for t in tensor.as_numpy().reshape(-1)]

    def _write(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.folder is None or self._tally is None or (not force and now - self._written < _WRITE_EVERY_S):
            return
        self._written = now
        with self._lock:
            data = json.dumps(self._tally.to_dict())
        path = tally_path(self.folder, self.model, self.instance)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        try:
            tmp.write_text(data)
            os.replace(tmp, path)
        except OSError as exc:
            self.log(f"model-factory backend: {self.model}: shadow tally not written: {exc}")

    def close(self) -> None:
        if self._thread is not None:
            try:
                self._queue.put(None, timeout=5)
            except queue.Full:
                return  # a daemon thread: it ends with the stub
            self._thread.join(timeout=5)
