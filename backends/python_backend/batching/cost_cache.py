"""What an instance learned about its engine's costs, kept for the next load — outside the repository.

The signed model repository is never written. ``model-factory serve`` names a
cache folder in ``MODEL_FACTORY_COST_CACHE`` for the server (the backend reads it
once, at load). One file per (engine bytes, device): the key is the sha256 of the
engine file the backend loaded, the engine flavour, the device (CPU model and
core count, or the GPU's name) and the optimization profiles, so a rebuilt
engine, another machine or another profile set never reads constants learned
for something else. Files are written to a temporary name and renamed (a reader
never sees half a file), and a file that cannot be read or does not fit is
ignored: the instance then warms up as if there were none. The instances of a
model share one file: each save reads what is there, merges this instance's
learning into it and writes the result under a lock (:func:`update_state`).
Standard library only: this runs inside Triton's stub.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

ENV = "MODEL_FACTORY_COST_CACHE"


def cache_dir_from_env(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The cache folder named by ``MODEL_FACTORY_COST_CACHE``, or None (no cache)."""
    value = environ.get(ENV, "").strip()
    return Path(value) if value else None


def cpu_description() -> str:
    """This machine's CPU model and the cores this process may use."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 0
    return f"{name} x{cores}"


def device_description(engine_info: Mapping[str, Any], instance_kind: str, device_id: int) -> str:
    """The device the engine runs on, as a cache key part: the GPU's name for a GPU instance, else the CPU."""
    if instance_kind == "GPU" or str(engine_info.get("device", "")).startswith("cuda"):
        name = engine_info.get("device_name")
        if not name:
            try:
                import sys

                torch = sys.modules.get("torch")  # only if the engine already imported it
                name = torch.cuda.get_device_name(int(device_id)) if torch is not None else None
            except Exception:  # noqa: BLE001 - a name is a nicety; the id still separates devices
                name = None
        return f"gpu{int(device_id)}:{name or 'unknown'}"
    return f"cpu:{cpu_description()}"


def cache_key(engine_sha256: str, flavour: str, device: str, buckets: Sequence[int], per_profile: bool) -> str:
    """The file stem for one engine on one device (hex, 32 characters)."""
    text = json.dumps([engine_sha256, flavour, device, [int(b) for b in buckets], bool(per_profile)])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cache_path(folder: Path, model: str, key: str) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model) or "model"
    return Path(folder) / f"{safe}-{key}.json"


def load_state(path: Path, required: str = "estimator") -> tuple[dict[str, Any] | None, str]:
    """``(state, why)``: the saved state, or None and the reason (missing, unreadable, malformed).

    ``required``: the field a usable file holds (an object): the estimator's state for the backend, the
    measured queue-bound cost for ``serve`` (``model_factory.serving.queue_bound``).
    """
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None, "no learned constants yet"
    except (OSError, ValueError) as exc:
        return None, f"cannot read {path}: {exc}"
    if not isinstance(data, dict) or not isinstance(data.get(required), dict):
        return None, f"{path} is not a cost model cache file"
    return data, ""


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path``'s lock file (``.<name>.lock`` beside it) for the block.

    Every instance of a model on this machine saves to the same file: the lock makes each one's
    read-merge-write whole, so no instance's learning overwrites another's. Without ``fcntl`` (not
    POSIX) the block runs unlocked.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path.parent / f".{path.name}.lock", "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def update_state(path: Path, merge: Callable[[dict[str, Any] | None], Mapping[str, Any]]) -> None:
    """Read the saved state (None when there is none usable), ``merge`` it with this instance's, write it.

    Under :func:`locked` and written atomically: two instances saving at once both keep what they learned.
    """
    with locked(path):
        current, _why = load_state(path)
        save_state(path, merge(current))


def save_state(path: Path, state: Mapping[str, Any]) -> None:
    """Write ``state`` atomically (temporary file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
