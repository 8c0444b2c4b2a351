"""The walls of a recipe's build stages: what export, quantize and engine build may read and write.

Read: the source (the Hugging Face folder, the ONNX file's folder, a torch factory's folder beside the
recipe), the recipe file, the calibration and held-out data, the Python environment (the venv, the
interpreter's install, this package's folders) and the system's libraries. Write: the recipe's work folder
(the stages' outputs and a private temporary folder) and the timing cache. Nothing else: not ``/etc`` (but
``ld.so.cache``), not the home folder, not ``/tmp``. :mod:`model_factory.sandbox` puts a stage behind them.
"""

from __future__ import annotations

from pathlib import Path

from model_factory.recipe import Recipe
from model_factory.sandbox import SYSTEM_FILES, SYSTEM_READ, Walls, gpu_devices, python_paths


def stage_walls(recipe: Recipe, stage: str) -> Walls:
    """The walls of ``stage`` of a build of ``recipe``."""
    src = recipe.source
    read: set[str] = set(python_paths()) | set(SYSTEM_READ)
    if src.path is not None:
        p = Path(src.path).resolve()
        read.add(str(p if p.is_dir() else p.parent))  # an ONNX file's external data lies beside it
    if src.gguf is not None:  # a gguf source's folder (under the work folder) and the file it came from
        read.add(str(Path(src.gguf).resolve().parent))
    if src.base_dir is not None:
        read.add(str(Path(src.base_dir).resolve()))  # a torch factory's module, the recipe's own folder
    adapter = getattr(recipe, "adapter", None)
    if adapter is not None:  # a LoRA adapter's check reads its base's packaged graph and Hugging Face folder
        read.update((str(Path(adapter.version_dir).resolve()), str(Path(adapter.source).resolve())))
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
    devices = ("/dev/null", *gpu_devices())
    return Walls(read=tuple(sorted(read)), write=tuple(sorted(write)), read_files=tuple(sorted(read_files)),
                 rw_files=devices, what=f"{stage} stage", tmpdir=str(work / ".tmp" / stage))
