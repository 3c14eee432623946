#!/usr/bin/env bash
# GPU checks on a machine that already has a CUDA build of torch (no Docker, no tox):
# installs the project without touching torch, runs the standard profile on CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --no-deps -e . >/dev/null
python -m pip install "pytest>=8" "pytest-xdist>=3.5" "rich>=13" >/dev/null
python -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
gradparity run --device cuda --profile "${PROFILE:-standard}" --report-dir "${REPORT_DIR:-reports/gpu}" "$@"
