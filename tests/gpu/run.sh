#!/usr/bin/env bash
# The GPU checks, in one short run, on a machine with a CUDA device:
#   bash tests/gpu/run.sh
# Prints what each measured (-s); without a CUDA device every test is skipped.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
exec "$PY" -m pytest -q -s -m gpu tests/gpu -p no:cacheprovider
