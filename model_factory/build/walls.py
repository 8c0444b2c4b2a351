"""The walls of a recipe's build stages: what export, quantize and engine build may read and write.

Read: the source (the Hugging Face folder, the ONNX file's folder, a torch factory's folder beside the
recipe), the recipe file, the calibration and held-out data, the Python environment (the venv, the
interpreter's install, this package's folders) and the system's libraries. Write: the recipe's work folder
(the stages' outputs and a private temporary folder) and the timing cache. Nothing else: not ``/etc`` (but
``ld.so.cache``), not the home folder, not ``/tmp``. :mod:`model_factory.sandbox` puts a stage behind them.
"""

from __future__ import annotations

import importlib.util
import sys
import sysconfig
from pathlib import Path

from model_factory.recipe import Recipe
from model_factory.sandbox import Walls

# /sys/devices and /sys/bus/pci: the CPU topology (OpenMP, ONNX Runtime) and the GPUs (device discovery, CUDA).
SYSTEM_READ = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/local/cuda", "/lib", "/lib64", "/usr/share/zoneinfo",
               "/sys/devices", "/sys/bus/pci", "/sys/fs/cgroup", "/proc/self", "/proc/thread-self",
               "/proc/driver/nvidia")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/proc/cpuinfo", "/proc/meminfo", "/proc/stat",
                "/proc/sys/kernel/osrelease",
                "/dev/urandom", "/dev/random")
# This package's folders (pyproject's package-dir maps several folders into model_factory).
PACKAGES = ("model_factory", "model_factory.build_engines", "model_factory.backend", "model_factory.cli")


def python_paths() -> list[str]:
    """The interpreter's install, the venv, every import-path folder and this package's own folders."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths |= {v for k, v in sysconfig.get_paths().items() if v}
    paths |= {p for p in sys.path if p and Path(p).exists()}
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        paths |= set(getattr(spec, "submodule_search_locations", None) or [])
    # Python's own executable may be a link into another folder (pyenv, a system python).
    paths.add(str(Path(sys.executable).resolve().parent.parent))
    return sorted(paths)


def stage_walls(recipe: Recipe, stage: str) -> Walls:
    """The walls of ``stage`` of a build of ``recipe``."""
    src = recipe.source
    read: set[str] = set(python_paths()) | set(SYSTEM_READ)
    if src.path is not None:
        p = Path(src.path).resolve()
        read.add(str(p if p.is_dir() else p.parent))  # an ONNX file's external data lies beside it
    if src.base_dir is not None:
        read.add(str(Path(src.base_dir).resolve()))  # a torch factory's module, the recipe's own folder
    q = recipe.quantization
    read_files = set(SYSTEM_FILES)
    for data in (q.calibration_data, q.heldout_data, recipe.recipe_path):
        if data is not None:
            read_files.add(str(Path(data).resolve()))
    work = Path(recipe.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    write = {str(work)}
    if recipe.tensorrt.timing_cache is not None:
        cache_dir = Path(recipe.tensorrt.timing_cache).resolve().parent
        cache_dir.mkdir(parents=True, exist_ok=True)
        write.add(str(cache_dir))
    # The GPU's device files (an engine build on a GPU machine): read, written and ioctl'ed, nothing else in /dev.
    devices = ("/dev/null", *sorted(str(p) for p in Path("/dev").glob("nvidia*") if not p.is_dir()))
    return Walls(read=tuple(sorted(read)), write=tuple(sorted(write)), read_files=tuple(sorted(read_files)),
                 rw_files=devices, what=f"{stage} stage", tmpdir=str(work / ".tmp" / stage))
