#!/usr/bin/env bash
# The GPU suite in one command (scripts/gpu_suite.py; --cpu runs it on tiny twins, as CI does).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 scripts/gpu_suite.py "$@"
