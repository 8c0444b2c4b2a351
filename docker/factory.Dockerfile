# The factory image: NVIDIA's TensorRT container plus model-factory, installed with no
# package index from the wheelhouse built by `model-factory wheelhouse` (docs/deployment.md).
#
# Build context: the repository root (docker-compose.yml sets it). Only wheelhouse/ and the
# entrypoint are sent, see factory.Dockerfile.dockerignore. No `# syntax=` line on purpose:
# that would make BuildKit pull a frontend image, which an air-gapped host cannot do.
ARG REGISTRY=nvcr.io
ARG TRT_TAG=25.10
FROM ${REGISTRY}/nvidia/tensorrt:${TRT_TAG}-py3

# Extras of model-factory to install; the wheelhouse must hold them (built for Python 3.12,
# manylinux x86_64 for the 25.xx images). EXTRA_PACKAGES: further wheels in the wheelhouse.
ARG FACTORY_EXTRAS=export,onnx,sign
ARG EXTRA_PACKAGES=

# The index files stay in the image as a record of exactly what was installed.
COPY wheelhouse/manifest.json wheelhouse/SHA256SUMS wheelhouse/requirements.txt /opt/model-factory/wheelhouse/

# The wheels themselves are bind-mounted for this step only, so a multi-GB wheelhouse
# (CUDA torch) is not copied into a layer. --no-index: nothing is fetched from anywhere.
RUN --mount=type=bind,source=wheelhouse,target=/tmp/wheelhouse \
    set -eux; \
    (cd /tmp/wheelhouse && sha256sum --check --strict --quiet SHA256SUMS); \
    python3 -c "import json, sys; m = json.load(open('/tmp/wheelhouse/manifest.json')); t = m['target']['python_version'] or m['built_with']['python'].rsplit('.', 1)[0]; here = '%d.%d' % sys.version_info[:2]; sys.exit(None if t == here else f'the wheelhouse is for Python {t}, this image has {here}: rebuild it with --python-version {here}')"; \
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir --no-index \
        --find-links /tmp/wheelhouse "model-factory[${FACTORY_EXTRAS}]" ${EXTRA_PACKAGES}; \
    python3 -c "import numpy, tensorrt; assert numpy.__version__.startswith('1.'), numpy.__version__; print('tensorrt', tensorrt.__version__)"; \
    model-factory --help > /dev/null

COPY --chmod=0755 docker/factory-entrypoint.sh /usr/local/bin/factory-entrypoint

# Belt and braces: the service runs with network_mode none, and nothing may try a hub or index.
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PIP_NO_INDEX=1 \
    PYTHONUNBUFFERED=1
WORKDIR /workspace
# NVIDIA's ENTRYPOINT is kept; it runs this command after its banner.
CMD ["factory-entrypoint"]
