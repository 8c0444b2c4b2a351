#!/usr/bin/env bash
# The test command (README and .ci/run): install if needed, then the whole suite on the CPU.
# GPU tests skip with a reason here; benchmarks/gpu_checks.sh runs them on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
