"""A rollout's plan: what is asked (:class:`RolloutRequest`), how far it got (:class:`RolloutStatus`), what a switch
leaves to undo (:class:`Switched`), and the configurations a switch loads (:func:`version_config`, :func:`switch_plan`).

No server here: :class:`~.rollout.RolloutControl` runs the steps (``rollout.py``), the candidate is staged and
accepted by ``rollout_candidate.py``, and the mirror judges it (``rollout_mirror.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from model_factory.errors import FactoryError

# States a rollout goes through; the last four are final.
STATES = ("verifying", "accepting", "loading", "shadowing", "switching", "switched", "rolled_back", "failed", "undone")
FINAL = ("switched", "rolled_back", "failed", "undone")
CLEANUP_WAIT_S = 60.0  # how long a new rollout (or undo) waits for the last one's cleanup (a candidate's unload)
# How long a load at the lowest priority (the candidate's, the switch's) may take: on cores that live traffic keeps
# busy it gets what traffic leaves (MiniLM's two stubs: 28-40 s on 2 saturated cores, 1 s idle), and the serving
# version answers meanwhile.
QUIET_LOAD_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class RolloutRequest:
    """What to roll out, and the gate it must pass."""

    model: str
    version: int
    # The least mean agreement over the mirrored requests: cosine; 1 or 0 for top-1; a text-generation model's
    # token agreement (backend/shadow.py: the same tokens from the first on, over the longer continuation).
    gate: float = 0.99
    min_requests: int = 50  # requests mirrored before the gate is judged
    share: float = 1.0  # the share of live requests mirrored
    timeout_s: float = 300.0  # without min_requests mirrored by then: rolled back
    grace_s: float = 600.0  # how long `rollout --undo` may switch back
    accept: bool = True  # acceptance of the candidate on this machine first

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RolloutRequest":
        try:
            req = cls(model=str(data["model"]), version=int(data["version"]),
                      **{k: type(getattr(cls, k))(data[k]) for k in ("gate", "min_requests", "share", "timeout_s",
                                                                        "grace_s", "accept") if k in data})
        except (KeyError, TypeError, ValueError) as exc:
            raise FactoryError(f"a rollout needs model and version (and numbers for its gate): {exc}. "
                               "Fix: model-factory rollout MODEL VERSION") from None
        if not (0 < req.share <= 1) or req.min_requests < 1 or not (-1 <= req.gate <= 1):
            raise FactoryError("share must be in (0, 1], min_requests at least 1 and gate in [-1, 1]. "
                               "Fix: pass --share, --min-requests and --gate in those ranges")
        return req


@dataclass(frozen=True)
class Switched:
    """A switch that may be undone until ``until`` (time.time()): with the previous version still loaded
    (``kept``), or, where the new version's configuration differs, by loading it again with ``previous_config``."""

    model: str
    previous: int
    current: int
    until: float
    kept: bool = True
    previous_config: str = ""  # the load configuration (Triton JSON) the previous version served with


@dataclass
class RolloutStatus:
    """A rollout's progress, as the control endpoint reports it (JSON)."""

    id: str
    model: str
    version: int
    serving: int
    state: str = "verifying"
    mirrored: int = 0
    agreement: float | None = None
    min_score: float | None = None
    candidate_errors: int = 0
    skipped: int = 0
    worst: list = field(default_factory=list)  # [{"score", "input_hash"}], lowest first
    reason: str = ""
    gate: float = 0.0
    min_requests: int = 0
    started: float = field(default_factory=time.time)
    seconds_to_switch: float | None = None  # from the command to the served version changed
    undo_until: float | None = None
    # What judges the new version: "mirror" (its agreement with the serving one over live requests), or
    # "acceptance" (a prompt template, a LoRA adapter: not mirrored, its acceptance on this machine is the gate).
    judged_by: str = "mirror"
    accepted: str = ""  # the acceptance's verdict, for one judged by it

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))



def version_config(base: dict[str, Any], versions: int | Sequence[int], name: str | None = None) -> dict[str, Any]:
    """A model's Triton configuration (JSON form) set to load exactly ``versions`` (and renamed). Requests that
    name no version go to the highest."""
    wanted = sorted({int(v) for v in ([versions] if isinstance(versions, int) else versions)})
    version = wanted[-1]
    out = dict(base)
    out["version_policy"] = {"specific": {"versions": wanted}}
    if name:
        out["name"] = name
    # Instance names of their own per version. Seen on Triton 2.51 (bundled) under load: a reload whose new
    # instances were named like the running ones (``<model>_0_0``) ended with the old stubs aborting at unload
    # (glibc "corrupted double-linked list" / "unaligned tcache chunk") and the requests they held hanging; with
    # ``<model>_v<version>_<group>`` the same reload lost nothing. The cause, as far as measured: the backend's
    # custom metrics carry the instance name as a label, so old and new stubs held pb_utils Metrics with identical
    # labels; with the same names but the stub's pid added to that label, the reload was clean (2 of 2 runs, 4 of
    # 4 aborts without). A version kept loaded beside a newer one keeps the instances (and names) of its own load:
    # Triton compares instance groups without their names.
    out["instance_group"] = [dict(g, name=f"{out.get('name', 'model')}_v{int(version)}_{i}")
                             for i, g in enumerate(out.get("instance_group") or [{}])]
    return out


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in config.items() if k != "version_policy"}
    out["instance_group"] = [{k: v for k, v in g.items() if k != "name"} for g in config.get("instance_group") or [{}]]
    return out


def switch_plan(serving_config: dict[str, Any], new_config: dict[str, Any], previous: int, version: int,
                grace_s: float) -> tuple[list[int], bool]:
    """The versions the switch loads, and whether the previous one stays loaded for the grace period. One Triton
    model has one configuration for all its loaded versions, and Triton loads a kept version again when the
    configuration changes in more than its version policy and instance names. So the previous version is kept
    only when the new version's configuration is the serving one but for those; else the switch loads the new
    version alone (with its own configuration) and an undo loads the previous one again with its own."""
    kept = grace_s > 0 and _comparable(serving_config) == _comparable(new_config)
    return ([previous, version] if kept else [version]), kept



def signed_config(model_dir: Path, version: int | None = None) -> dict[str, Any]:
    """The configuration (Triton JSON) of ``version`` as signed with it, else the model's ``config.pbtxt``."""
    from google.protobuf import json_format

    from model_factory.build.repository import read_version_config

    return json_format.MessageToDict(read_version_config(model_dir, version), preserving_proto_field_name=True)

