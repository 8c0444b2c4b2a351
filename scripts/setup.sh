#!/usr/bin/env bash
# Create .venv (if missing) and install model-factory with every extra the demo and the tests use.
# Idempotent: a second run only re-checks the install.
#   PYTHON=python3.11 scripts/setup.sh          choose the interpreter
#   WHEELHOUSE=/media/wheels scripts/setup.sh   install offline from a wheelhouse (see docs/deployment.md)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if [ -n "${WHEELHOUSE:-}" ]; then
  PIP+=(--no-index --find-links "$WHEELHOUSE")
fi
# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build. 2.13.0 is the CPU build these
# machines keep on local disk; on a GPU host set TORCH_SPEC to the build you want.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${PIP[@]}" "${TORCH_SPEC:-torch==2.13.0}"
fi
"${PIP[@]}" -e ".[all]"
# Optional: Debian's docker-compose validates docker-compose.yml without an engine (a test uses it
# and skips without it). Best effort: only as root, only where apt works.
if ! command -v docker-compose >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1 \
   && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ -z "${WHEELHOUSE:-}" ]; then
  (apt-get install -y -q docker-compose >/dev/null 2>&1 \
   || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q docker-compose >/dev/null 2>&1; }) \
   || echo "note: docker-compose not installed; the compose 'config' test will skip" >&2
fi
# Optional: a real OCI registry (Debian's docker-registry, CNCF Distribution 2.8), skopeo and htpasswd for
# the distribution tests (push/pull through a registry; they skip without them). Best effort, as above.
if ! command -v docker-registry >/dev/null 2>&1 || ! command -v skopeo >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ -z "${WHEELHOUSE:-}" ]; then
    (apt-get install -y -q docker-registry skopeo apache2-utils >/dev/null 2>&1 \
     || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q docker-registry skopeo apache2-utils >/dev/null 2>&1; }) \
     || echo "note: docker-registry/skopeo not installed; the OCI registry tests will skip" >&2
  fi
fi
# Optional: Debian's chromium renders the release report in the browser tests (headless, offline); they skip
# without it. Best effort, as for docker-compose.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
   && [ -z "${WHEELHOUSE:-}" ]; then
  (apt-get install -y -q chromium >/dev/null 2>&1 \
   || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }) \
   || echo "note: chromium not installed; the report's browser tests will skip" >&2
fi
