"""A rollout's traffic mirror and its agreement: the backend's shadow (``backend/operations/shadow.py``) turned on
for a candidate through its control file, its tallies summed over the model's instances, and the gate judged on
their mean score (a prompt template or a LoRA adapter is not mirrored: its acceptance is its gate)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

from model_factory.serving.rollout_candidate import candidate_name
from model_factory.serving.rollout_plan import RolloutRequest, RolloutStatus


def shadow_dir(server: Any) -> Path:
    """The folder of ``server``'s mirrors: their control files and tallies."""
    from model_factory.backend.operations.shadow import SHADOW_DIR

    return Path(server.work_dir) / SHADOW_DIR


def summed_tallies(folder: Path, model: str, rollout_id: str) -> dict[str, Any]:
    """The mirrors' tallies of one rollout, summed over the model's instances."""
    total = {"mirrored": 0, "score_sum": 0.0, "min_score": None, "errors": 0, "skipped": 0, "worst": []}
    for path in sorted(Path(folder).glob(f"{model}.*.tally.json")):
        try:
            t = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if t.get("id") != rollout_id:
            continue
        for k in ("mirrored", "score_sum", "errors", "skipped"):
            total[k] += t.get(k) or 0
        if t.get("min_score") is not None:
            total["min_score"] = t["min_score"] if total["min_score"] is None else min(total["min_score"],
                                                                                       t["min_score"])
        total["worst"] = sorted(total["worst"] + list(t.get("worst") or []), key=lambda w: w["score"])[:5]
    return total



def mirror_and_judge(folder: Path, req: RolloutRequest, status: RolloutStatus, *, stop: threading.Event,
                     poll_s: float, set_state: Callable[..., None]) -> bool:
    """Mirror until ``min_requests`` were scored; True when the gate passed (False: rolled back, said through
    ``set_state(status, state, reason)``)."""
    from model_factory.backend.operations.shadow import control_path
    from model_factory.fileio import atomic_file

    for old in Path(folder).glob(f"{req.model}.*.tally.json"):  # earlier rollouts' (their ids differ anyway)
        old.unlink(missing_ok=True)
    with atomic_file(control_path(folder, req.model)) as f:
        f.write(json.dumps({"id": status.id, "target": candidate_name(req.model), "share": req.share}))
    deadline = time.monotonic() + req.timeout_s
    while True:
        t = summed_tallies(folder, req.model, status.id)
        status.mirrored, status.candidate_errors, status.skipped = t["mirrored"], t["errors"], t["skipped"]
        status.min_score, status.worst = t["min_score"], t["worst"]
        status.agreement = t["score_sum"] / t["mirrored"] if t["mirrored"] else None
        if t["errors"]:
            set_state(status, "rolled_back", f"the candidate failed {t['errors']} of {t['mirrored']} mirrored "
                      "requests the serving version answered")
            return False
        if t["mirrored"] >= req.min_requests:
            break
        if stop.is_set():
            set_state(status, "rolled_back", "serve is stopping")
            return False
        if time.monotonic() > deadline:
            set_state(status, "rolled_back", f"only {t['mirrored']} of {req.min_requests} requests mirrored "
                      f"within {req.timeout_s:g} s: not enough traffic to judge. Fix: retry under load, or "
                      "lower --min-requests")
            return False
        time.sleep(poll_s)
    stop_mirroring(folder, req.model)
    if status.agreement is None or status.agreement < req.gate:
        set_state(status, "rolled_back", f"agreement {status.agreement:.6f} over {status.mirrored} mirrored "
                  f"requests is below the gate {req.gate:g} (lowest {status.min_score:.6f}); worst by input "
                  "hash: " + ", ".join(f"{w['input_hash']} {w['score']:.4f}" for w in status.worst))
        return False
    return True


def stop_mirroring(folder: Path, model: str) -> None:
    from model_factory.backend.operations.shadow import control_path

    control_path(folder, model).unlink(missing_ok=True)
