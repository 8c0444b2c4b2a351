#!/usr/bin/env bash
# GPU checks, as one prepared script for a machine with an NVIDIA GPU (no network needed).
#
#   bash benchmarks/gpu_checks.sh        # from anywhere; runs in the repository root
#
# Writes everything it prints to $OUT/gpu_checks.log when $OUT is set.
# Exits non-zero if any check failed.
#
# Expects on that machine: python3 with cuda-bindings (and torch with CUDA for the
# cost-model check; pytest for the gpu-marked unit tests, skipped without it). The Triton
# check needs .whl/ from benchmarks/prepare_gpu_wheels.sh (run on a CPU machine first):
#
#   device run: command "bash benchmarks/gpu_checks.sh", carry [".whl"], timeout_s 560
#
# Sections: the backend's CUDA checks; the gpu-marked unit tests; Triton with 256 requests on the torch
# engine; `accept` on the torch engine (the packaged golden inputs, needs .whl/polygraphy-*.whl); ONNX
# Runtime CUDA (engine test, accept, Triton with engine=onnxruntime, text generation with the KV cache in the
# pool) when onnxruntime-gpu was staged (ORT_GPU=1 benchmarks/prepare_gpu_wheels.sh: .whl-ort/part-NN carried
# one per call first); the GPU batching benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."

LOG=/dev/null
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    LOG="$OUT/gpu_checks.log"
    : >"$LOG"
fi
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
rc=0

section() { echo "=== $* ===" | tee -a "$LOG"; }

section "backend CUDA checks (benchmarks/gpu_checks.py)"
timeout 300 "$PY" benchmarks/gpu_checks.py 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

section "gpu-marked unit tests (tests/backend)"
if "$PY" -c "import pytest" 2>/dev/null; then
    PYTHONPATH="$PWD" timeout 300 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
        tests/backend/test_memory_pool.py tests/backend/test_torch_engine.py tests/backend/test_kv_device.py \
        2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
else
    echo "SKIP pytest is not installed here" | tee -a "$LOG"
fi

# ============================================================================
# Triton: 256 concurrent mixed-length requests through the real server on this machine, served by
# the torch engine on the GPU (the log must say so: no ONNX Runtime fallback), every output checked
# against a PyTorch reference (benchmarks/gpu_checks.py triton).
# Needs what benchmarks/prepare_gpu_wheels.sh put into .whl/ on a CPU machine (carry ".whl"):
#   .whl/numpy-1.26.4-cp312-*.whl           the stub's Python must have numpy<2 (docs/environment.md)
#   .whl/tritonserver-2.51.0-slim.tar.xz    tritonserver, the Python backend, the 3.12 stub, libs
#   .whl/gpu_triton/                        the packaged tiny model (KIND_GPU, engine=torch: ONNX and
#                                           model.torchscript.pt) and refs.npz
# ============================================================================
# Triton, its stub's Python and model_factory, set up once for the two Triton sections below.
T=${TMPDIR:-/tmp}/mf-gpu-triton
triton_env() {
    set -e
    rm -rf "$T" && mkdir -p "$T"
    # A venv over the system site-packages (torch, onnxruntime, cuda-bindings stay visible), with
    # numpy 1.26.4 in front of the system's numpy 2: the stub runs the first python3 on PATH.
    "$PY" -m venv --system-site-packages --without-pip "$T/venv"
    SITE=$("$T/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$NUMPY_WHL"
    TC_WHL=$(ls .whl/tritonclient-*.whl 2>/dev/null | head -1)
    if [ -n "$TC_WHL" ]; then  # the batching benchmark's client (pure Python)
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$TC_WHL"
    fi
    PG_WHL=$(ls .whl/polygraphy-*.whl 2>/dev/null | head -1)
    if [ -n "$PG_WHL" ]; then  # reads the acceptance data (pure Python, no dependencies)
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$PG_WHL"
    fi
    "$T/venv/bin/python" -c 'import numpy, onnxruntime; print("stub python: numpy", numpy.__version__, "onnxruntime", onnxruntime.__version__)'
    # The Triton bundle keeps the wheel's layout, so the binaries' RUNPATHs find nvidia_pytriton.libs.
    tar -xJf "$BUNDLE" -C "$T"
    BACKEND="$T/pytriton/tritonserver/backends/python"
    cp "$T/pytriton/tritonserver/python_backend_stubs/3.12/triton_python_backend_stub" "$BACKEND/"
    # model_factory as one import package, mapped as pyproject.toml maps it (no install needed).
    PKG="$T/pkg/model_factory"
    mkdir -p "$PKG"
    cp -r model_factory/. "$PKG/"
    cp -r cli "$PKG/cli"
    cp -r build_engines "$PKG/build_engines"
    cp -r backends/python_backend "$PKG/backend"
}
in_triton_env() {
    PATH="$T/pytriton/tritonserver/bin:$PATH" \
    LD_LIBRARY_PATH="$T/nvidia_pytriton.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    PYTHONPATH="$T/pkg" "$@"
}

BUNDLE=$(ls .whl/tritonserver-*-slim.tar.xz 2>/dev/null | head -1)
NUMPY_WHL=$(ls .whl/numpy-1.26.4-cp3*-*.whl 2>/dev/null | head -1)
TRITON_OK=0
if [ -z "$BUNDLE" ] || [ -z "$NUMPY_WHL" ]; then
    echo "SKIP .whl/ lacks the Triton bundle or the numpy 1.26.4 wheel: run" \
         "benchmarks/prepare_gpu_wheels.sh on a CPU machine and carry .whl" | tee -a "$LOG"
    rc=1
elif (triton_env) 2>&1 | tee -a "$LOG"; then  # pipefail: fails when triton_env does
    TRITON_OK=1
else
    echo "FAIL setting up Triton and its stub's Python" | tee -a "$LOG"
    rc=1
fi

section "Triton: 256 concurrent mixed-length requests, every output checked (gpu_checks.py triton)"
if [ "$TRITON_OK" -eq 1 ] && [ -f .whl/gpu_triton/refs.npz ]; then
    in_triton_env timeout 300 "$T/venv/bin/python" benchmarks/gpu_checks.py triton --out .whl/gpu_triton \
        --log-dir "${OUT:-$T}" 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
else
    echo "SKIP no Triton set up, or .whl/gpu_triton/refs.npz is missing (prepare_gpu_wheels.sh)" | tee -a "$LOG"
fi

section "accept on the GPU: the packaged golden inputs through the torch engine (gpu_checks.py accept)"
if [ "$TRITON_OK" -eq 1 ] && ls .whl/polygraphy-*.whl >/dev/null 2>&1; then
    in_triton_env timeout 120 "$T/venv/bin/python" benchmarks/gpu_checks.py accept --model tiny --out .whl/gpu_triton \
        2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
else
    echo "SKIP no Triton set up, or .whl/ lacks the polygraphy wheel (prepare_gpu_wheels.sh)" | tee -a "$LOG"
fi

# ============================================================================
# ONNX Runtime CUDA: the engine's GPU test, accept, and the 256-request Triton check with engine=onnxruntime.
# Needs onnxruntime-gpu 1.31.1 (cp312), which is staged: prepare_gpu_wheels.sh with ORT_GPU=1 cuts it into
# .whl-ort/part-NN carried one per call (see there); here the parts are joined and checked against
# .whl/ort-gpu.sha256, and installed into a venv of its own over the Triton one, in front of the image's
# CPU onnxruntime (the two wheels must never share an environment). Its CUDA/cuDNN libraries come from the
# nvidia-* wheels torch cu130 brought (onnxruntime.preload_dlls).
# ============================================================================
section "ONNX Runtime CUDA: engine test, accept and the Triton check (engine=onnxruntime, tiny-ort)"
ORT_OK=0
if [ "$TRITON_OK" -eq 1 ] && [ -f .whl/ort-gpu.sha256 ] && ls .whl-ort/part-* >/dev/null 2>&1; then
    ORT_NAME=$(awk '{print $2}' .whl/ort-gpu.sha256)
    cat .whl-ort/part-* > ".whl-ort/$ORT_NAME"
    if (cd .whl-ort && sha256sum --check --strict --quiet ../.whl/ort-gpu.sha256) 2>&1 | tee -a "$LOG"; then
        "$PY" -m venv --system-site-packages --without-pip "$T/venv-ort"
        ORT_SITE=$("$T/venv-ort/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        SITE_DIR=$("$T/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        # The Triton venv's site (numpy 1.26.4, tritonclient, polygraphy) first, then onnxruntime-gpu over it.
        cp -r "$SITE_DIR"/. "$ORT_SITE"/ 2>/dev/null || true
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$ORT_SITE" ".whl-ort/$ORT_NAME" \
            2>&1 | tee -a "$LOG" && ORT_OK=1
    else
        echo "FAIL the joined onnxruntime-gpu wheel does not match .whl/ort-gpu.sha256 (a part missing?)" | tee -a "$LOG"
        rc=1
    fi
else
    echo "SKIP onnxruntime-gpu is not staged here (prepare_gpu_wheels.sh with ORT_GPU=1, parts carried one per call)" \
        | tee -a "$LOG"
fi
if [ "$ORT_OK" -eq 1 ]; then
    PYTHONPATH="$PWD" timeout 300 "$T/venv-ort/bin/python" -m pytest -q -m gpu -p no:cacheprovider \
        tests/backend/test_onnxruntime_cuda_engine.py 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    PATH="$T/venv-ort/bin:$PATH" in_triton_env timeout 120 "$T/venv-ort/bin/python" benchmarks/gpu_checks.py accept \
        --model tiny-ort --out .whl/gpu_triton 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    PATH="$T/venv-ort/bin:$PATH" in_triton_env timeout 300 "$T/venv-ort/bin/python" benchmarks/gpu_checks.py triton \
        --model tiny-ort --out .whl/gpu_triton --log-dir "${OUT:-$T}" 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi

# Text generation on the CUDA provider (issue 32's GPU path): the backend's scheduler, the fp16 graph on the
# instance's stream, the KV cache in device buffers from the pool sized from cudaMemGetInfo, 16 sequences
# together, each checked against the CPU's tokens (.whl/gpu_generate from gpu_checks.py prepare-generate).
section "ONNX Runtime CUDA: text generation, KV cache in the pool (gpu_checks.py generate)"
if [ "$ORT_OK" -eq 1 ] && [ -f .whl/gpu_generate/generate_refs.json ]; then
    timeout 300 "$T/venv-ort/bin/python" benchmarks/gpu_checks.py generate --out .whl/gpu_generate 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    # The same model through Triton on a KIND_GPU instance (served without its tokenizer: prompt ids).
    PATH="$T/venv-ort/bin:$PATH" in_triton_env timeout 300 "$T/venv-ort/bin/python" benchmarks/gpu_checks.py \
        generate-triton --out .whl/gpu_generate --log-dir "${OUT:-$T}" 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    # Speed: bench_generate's 110M Llama in fp16 (its graph carried, weights drawn there), 1 / 8 / 32 streams.
    timeout 300 "$T/venv-ort/bin/python" benchmarks/gpu_checks.py generate-speed --out .whl/gpu_generate 2>&1 \
        | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
else
    echo "SKIP needs onnxruntime-gpu staged and .whl/gpu_generate (prepare_gpu_wheels.sh)" | tee -a "$LOG"
fi

# ============================================================================
# Grouped batching on the GPU (issue 5's "≥ 0.95x the better of (b) and (c) on a GPU machine"):
# bench_batching.py with the torch engine on a KIND_GPU instance, MiniLM's architecture with random
# weights (.whl/minilm_hf: config and tokenizer), 3 interleaved rounds at 1/8/64 in flight and mixed. Its
# RESULTS.md section comes back as $OUT/RESULTS-gpu.md, to paste into benchmarks/RESULTS.md.
# ============================================================================
section "GPU batching benchmark: (a) ours vs (b) equal shapes vs (c) padded, torch on CUDA (bench_batching.py)"
if [ "$TRITON_OK" -eq 1 ] && [ -f .whl/minilm_hf/config.json ] && ls .whl/tritonclient-*.whl >/dev/null 2>&1; then
    in_triton_env timeout "${BENCH_TIMEOUT_S:-270}" "$T/venv/bin/python" benchmarks/bench_batching.py \
        --kind gpu --engine torch --source .whl/minilm_hf --random-weights --rounds 3 --no-snapshot --ready-rounds 0 \
        --work "$T/bench" --results "${OUT:-$T}/RESULTS-gpu.md" 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
else
    echo "SKIP no Triton set up, or .whl/ lacks minilm_hf/ or the tritonclient wheel (prepare_gpu_wheels.sh)" \
        | tee -a "$LOG"
fi

section "gpu_checks.sh: $([ "$rc" -eq 0 ] && echo 'all passed' || echo 'FAILED')"
exit "$rc"
