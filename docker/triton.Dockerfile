# The serving image: NVIDIA's Triton server container plus model-factory, installed with no
# package index from the wheelhouse built by `model-factory wheelhouse` (docs/deployment.md).
# `model-factory serve` verifies the repository and starts the tritonserver on PATH
# (/opt/tritonserver/bin), whose Python backend runs in this image's python3.
#
# Build context: the repository root (docker-compose.yml sets it). Only wheelhouse/ is sent,
# see triton.Dockerfile.dockerignore. No `# syntax=` line: an air-gapped host cannot pull one.
ARG REGISTRY=nvcr.io
ARG TRITON_TAG=25.10
FROM ${REGISTRY}/nvidia/tritonserver:${TRITON_TAG}-py3

# Extras of model-factory to install; the wheelhouse must hold them (Python 3.12, manylinux
# x86_64). `tensorrt` is the GPU engine: TensorRT's Python bindings (tensorrt-cu13-bindings
# 11.4.0.106, module tensorrt_bindings) on the TensorRT libraries this image already has, so a GPU
# instance serves the plan instead of refusing to load (it never falls back to the CPU unless the
# recipe allows it). The check below fails the build when the image's TensorRT does not match the
# bindings: pick TRITON_TAG for TensorRT 11.4. EXTRA_PACKAGES: further wheels in the wheelhouse.
ARG TRITON_EXTRAS=serve,sign,gpu,tensorrt
ARG EXTRA_PACKAGES=

COPY wheelhouse/manifest.json wheelhouse/SHA256SUMS wheelhouse/requirements.txt /opt/model-factory/wheelhouse/

# numpy must be 1.x in the Python the backend stub runs (see docs/environment.md); the package
# pins it, and the check below makes a wrong wheelhouse fail the build, not the first request.
RUN --mount=type=bind,source=wheelhouse,target=/tmp/wheelhouse \
    set -eux; \
    command -v tritonserver; \
    command -v curl; \
    (cd /tmp/wheelhouse && sha256sum --check --strict --quiet SHA256SUMS); \
    python3 -c "import json, sys; m = json.load(open('/tmp/wheelhouse/manifest.json')); t = m['target']['python_version'] or m['built_with']['python'].rsplit('.', 1)[0]; here = '%d.%d' % sys.version_info[:2]; sys.exit(None if t == here else f'the wheelhouse is for Python {t}, this image has {here}: rebuild it with --python-version {here}')"; \
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir --no-index \
        --find-links /tmp/wheelhouse "model-factory[${TRITON_EXTRAS}]" ${EXTRA_PACKAGES}; \
    python3 -c "import numpy, model_factory.backend; assert numpy.__version__.startswith('1.'), numpy.__version__"; \
    python3 -c "from model_factory.backend.memory_pool import import_tensorrt as t; m = t(); assert m.__name__ != 'tensorrt_rtx', m.__name__; print('GPU engine: TensorRT', m.__version__)"; \
    model-factory serve --help > /dev/null

ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PIP_NO_INDEX=1 \
    PYTHONUNBUFFERED=1
EXPOSE 8000 8001 8002 9000
# --host 0.0.0.0: serve listens on 127.0.0.1 by default, which published ports cannot reach.
CMD ["model-factory", "serve", "--host", "0.0.0.0", "--policy", "/run/secrets/trust_policy", "--openai-port", "9000", "/models"]
